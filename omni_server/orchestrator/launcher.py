"""Starts the stage processes of a pipeline (in parallel) and stops them cleanly."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from omni_server.config.schema import PipelineConfig
from omni_server.orchestrator.mps import PROGRAM as MPS_PROGRAM
from omni_server.orchestrator.mps import MPSDaemon, MPSError

log = logging.getLogger(__name__)


def _cuda_host() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_set(devices: str | None) -> set[str] | None:
    return None if devices is None else {d.strip() for d in devices.split(",") if d.strip()}


def _overlap(a: set[str] | None, b: set[str] | None) -> bool:
    return a is None or b is None or bool(a & b)  # None: every visible GPU


Unit = tuple[int, int]  # (stage id, replica): one engine process

FAILURE_CHARS = 2000  # of a stage's failure note read back: one exception's message, not a log


def failure_path(runtime_dir: str | Path, unit: Unit) -> Path:
    """Where a stage process that dies of an exception leaves its one-line reason (cli `stage`), so
    the server's own last line can say why instead of only an exit code."""
    return Path(runtime_dir) / f"stage-{unit[0]}-{unit[1]}.failed"


def failure_note(exc: BaseException) -> str | None:
    """The one-line reason for a stage process ending with `exc`; None for a clean exit."""
    if isinstance(exc, SystemExit):
        if exc.code is None or exc.code == 0:
            return None
        return exc.code if isinstance(exc.code, str) else f"exit code {exc.code}"
    if isinstance(exc, KeyboardInterrupt):
        return None
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Launcher:
    def __init__(self, cfg: PipelineConfig, runtime_dir: Path):
        self.cfg = cfg
        self.runtime_dir = runtime_dir
        # Stages start (and restart) from the validated config as `serve` read it, overrides applied
        # (written at the first start): a restart must not read a config file edited or moved since.
        self.config_path = str(runtime_dir / "pipeline.json")
        self.procs: dict[Unit, subprocess.Popen] = {}
        self.env: dict[str, str] = {}  # added to every stage process's environment
        self.cuda = _cuda_host()

        # vLLM sizes its KV cache from the GPU memory it sees used while it profiles, so while one
        # engine does, nothing else may allocate on its GPUs: engines sharing a GPU start one after
        # the other. On CPU hosts they all start at once.
        self.sequential = self.cuda

    def _profiles(self, stage_id: int) -> bool:
        """Whether the stage's engine measures GPU memory while starting: every vLLM (AR) stage
        but one given its KV cache size (`kv_cache_memory_bytes`: vLLM then skips the profiling)."""
        stage = self.cfg.stage(stage_id)
        return stage.kind == "ar" and not stage.engine_args.get("kv_cache_memory_bytes")

    def build_order(self) -> list[Unit]:
        """Stages that do not profile memory first (config order), then those that do: a
        generation stage (e.g. token2wav capturing its CUDA graphs) builds while the engines
        after it import, and is done allocating before any of them measures the GPU."""
        return sorted(self.cfg.units(), key=lambda u: self._profiles(u[0]))

    def start_after(self, unit: Unit) -> list[Unit]:
        """Processes that must be ready before this one builds: those before it in `build_order` on
        the same devices, unless neither of the two profiles memory (those build side by side)."""
        return self._waits_on_gpu(unit) if self.sequential else []

    def _waits_on_gpu(self, unit: Unit) -> list[Unit]:
        """`start_after` on a GPU host."""
        order = self.build_order()
        mine = _device_set(self.cfg.stage(unit[0]).devices_of(unit[1]))
        return [u for u in order[:order.index(unit)]
                if _overlap(mine, _device_set(self.cfg.stage(u[0]).devices_of(u[1])))
                and (self._profiles(u[0]) or self._profiles(unit[0]))]

    def gpu_start_notes(self) -> list[str]:
        """On a GPU host, which stages wait for others before they build, and why (`check` prints
        them: a pipeline whose engines profile memory on a shared GPU starts slower)."""
        waits = {u: self._waits_on_gpu(u) for u in self.cfg.units()}
        return [f"stage {u[0]} ({self.cfg.unit_name(u)}) builds after "
                f"{', '.join(self.cfg.unit_name(b) for b in before)} on a GPU host: "
                + ("its engine measures free GPU memory while it starts; `kv_cache_memory_bytes` in its "
                   "engine_args lets it build beside them" if self._profiles(u[0]) else
                   "an engine sharing its GPU measures free GPU memory while it starts")
                for u, before in waits.items() if before]

    def shares_a_gpu(self) -> bool:
        """Whether two stage processes may run on the same GPU."""
        devices = [_device_set(self.cfg.stage(u[0]).devices_of(u[1])) for u in self.cfg.units()]
        return any(_overlap(a, b) for a, b in itertools.combinations(devices, 2))

    def start_mps(self) -> MPSDaemon | None:
        """With `cuda_mps` on a CUDA host where stages share a GPU: start this server's MPS daemon
        and have every stage process use it. Raises MPSError when it cannot (`auto`: logs that,
        and the stages time-slice their GPUs as without it)."""
        if not (self.cfg.cuda_mps and self.cuda and self.shares_a_gpu()):
            return None
        daemon = MPSDaemon(self.runtime_dir / "mps")
        try:
            daemon.start()
        except MPSError as e:
            if self.cfg.cuda_mps != "auto":
                raise
            log.warning("cuda_mps: auto: no MPS (%s); the stages sharing a GPU time-slice it", e)
            return None
        self.env.update(daemon.env)
        return daemon

    def host_notes(self) -> list[str]:
        """What this host lacks for the pipeline on a GPU (`check` prints them)."""
        notes = []
        on_gpus = [s.name for s in self.cfg.stages if s.devices is not None or s.replica_devices is not None]
        if on_gpus and not self.cuda:
            notes.append(f"no CUDA device is visible here: {', '.join(on_gpus)} name GPUs (`devices`) and need "
                         "a GPU host to run as configured")
        if not (os.environ.get("CC") or any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
            notes.append("no C compiler on PATH (cc, gcc or clang; or CC): on a GPU host Triton, which vLLM and "
                         "token2wav's `compile` run, builds each kernel's launcher with one")
        if self.cfg.cuda_mps and self.shares_a_gpu() and shutil.which(MPS_PROGRAM) is None:
            notes.append(f"cuda_mps: {MPS_PROGRAM} is not on PATH (it comes with the NVIDIA driver): "
                         + ("the stages sharing a GPU will time-slice it" if self.cfg.cuda_mps == "auto"
                            else "`serve` will not start on a GPU host"))
        if not (self.cfg.cuda_mps and self.shares_a_gpu()):
            capped = [s.name for s in self.cfg.stages if "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in s.env]
            if capped:  # (only an MPS client reads it: time-slicing stages run on every SM)
                notes.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in the env of {', '.join(capped)} caps their SMs only "
                             "under MPS, which `serve` starts for stages sharing a GPU with `cuda_mps` on; here "
                             "it takes effect only if the stages run under an MPS daemon of your own")
        return notes

    def start(self, unit: Unit, hold: bool = False) -> None:
        """Start a stage process. `hold`: it imports everything, then waits for `release` before it
        builds its engine (the imports take ~15 s a process on the H200 host; they need not wait)."""
        stage_id, replica = unit
        if not self.procs:
            with open(os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump(self.cfg.model_dump(mode="json"), f)
        cmd = [sys.executable, "-m", "omni_server.cli", "stage", "--config", self.config_path,
               "--stage", str(stage_id), "--replica", str(replica), "--runtime-dir", str(self.runtime_dir),
               "--parent-pid", str(os.getpid())]
        if hold:
            cmd.append("--hold")
        failure_path(self.runtime_dir, unit).unlink(missing_ok=True)  # a restart's note is its own
        # Own session: a terminal Ctrl-C reaches only `serve`, which then stops stages in order.
        self.procs[unit] = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.PIPE if hold else None,
                                            env=os.environ | self.env if self.env else None)
        log.info("stage %d (%s) starting, pid %d%s", stage_id, self.cfg.unit_name(unit), self.procs[unit].pid,
                 " (builds its engine once the earlier stages on its GPUs are ready)" if hold else "")

    def release(self, unit: Unit) -> None:
        """Let a held stage process build its engine."""
        stdin = self.procs[unit].stdin
        if stdin is None:
            return
        try:
            stdin.write(b"go\n")
            stdin.close()
        except OSError:  # it already exited; supervision reports that
            pass

    def failure(self, unit: Unit) -> str | None:
        """The reason a stage process left before it died (see `failure_path`), if any."""
        try:
            with open(failure_path(self.runtime_dir, unit), encoding="utf-8", errors="replace") as f:
                text = f.read(FAILURE_CHARS + 1)
        except OSError:
            return None
        text = text.strip()
        return text[:FAILURE_CHARS] + " ..." if len(text) > FAILURE_CHARS else text or None

    def exited(self) -> dict[Unit, int]:
        """Exit codes of stage processes that are no longer running."""
        return {u: p.returncode for u, p in self.procs.items() if p.poll() is not None}

    def kill(self, unit: Unit) -> None:
        """SIGKILL a stage process and its children (its own process group): also what a stage that
        exited left behind (tensor-parallel workers, compile workers), which may hold GPU memory its
        restart needs."""
        try:
            os.killpg(self.procs[unit].pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # (the group is empty: nothing left)
            pass

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every stage, wait, then SIGKILL what is left of each (its children too)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for u, p in self.procs.items():
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("stage %s did not stop in %.0f s; killing it", self.cfg.unit_name(u), timeout)
            self.kill(u)
            p.wait()
