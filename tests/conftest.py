"""Shared fixtures: tiny checkpoints and real running servers (one per config per test session)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# Exact float32 on GPUs for the parity tests (this process's transformers reference and every server
# it starts inherit these; both are ignored on CPU): fp32 Triton dots (vLLM's attention, fused MoE)
# and cuBLAS / cuDNN (convolutions) would otherwise use TF32. The H200 run of 2026-11-30 saw talker
# codes, thinker tokens (audio input) and waveforms part from transformers without them.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "var" / "models"
STARTUP_TIMEOUT = 420


def pytest_runtest_logreport(report) -> None:
    """With OMNI_TEST_LOG_DIR set, each failure is written there as it happens (failures.txt) and
    each phase's outcome and seconds (times.txt), so a session killed by a time limit still says
    what failed, why, and where the time went."""
    keep = os.environ.get("OMNI_TEST_LOG_DIR")
    if not keep:
        return
    Path(keep).mkdir(parents=True, exist_ok=True)
    with open(Path(keep) / "times.txt", "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {report.duration:8.2f} s {report.when:8} {report.outcome:7} {report.nodeid}\n")
    if report.failed:
        with open(Path(keep) / "failures.txt", "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def edited_config(config: Path, out: Path, edit) -> Path:
    """A copy of test pipeline `config` at `out` (its stages' model paths made absolute), each stage's
    dict passed through `edit(stage)` first."""
    import yaml

    data = yaml.safe_load(config.read_text())
    for stage in data["stages"]:
        stage["model"] = str((config.parent / stage["model"]).resolve())
        edit(stage)
    out.write_text(yaml.safe_dump(data))
    return out


def compiled_config(config: Path, out: Path) -> Path:
    """A copy of test pipeline `config` at `out` whose AR stages run under vLLM's torch.compile, as
    real model configs do (the test configs run eager for a fast start)."""

    def compiled(stage: dict) -> None:
        if stage.get("kind", "ar") == "ar":
            stage.setdefault("engine_args", {})["enforce_eager"] = False
            stage.get("env", {}).pop("TORCHDYNAMO_DISABLE", None)

    return edited_config(config, out, compiled)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`omni-server serve CONFIG` as a real subprocess on a free loopback port."""

    def __init__(self, config: Path, log_path: Path, env: dict[str, str] | None = None, args: list[str] = ()):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        keep = os.environ.get("OMNI_TEST_LOG_DIR")  # e.g. CI artifacts: the log lives there from the start
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            log_path = Path(keep) / f"{log_path.parent.name}-{log_path.name}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_server.cli", "serve", str(config), "--port", str(self.port), *args],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.failure_report()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {STARTUP_TIMEOUT} s:\n{self.failure_report()}")

    def failure_report(self) -> str:
        """The log's error lines (a worker's root cause can be far from the end), then its tail."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        errors = [l for l in lines if "Error" in l or "ERROR" in l or "Traceback" in l][:60]
        return "error lines:\n" + "\n".join(errors) + "\n\nlog tail:\n" + self.log_tail()

    def log_tail(self, limit: int = 8000) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(l for l in lines if not l.startswith("WARNING: Location"))[-limit:]

    def stats(self, stage_id: int) -> dict:
        r = httpx.get(f"{self.base_url}/v1/omni/stages/{stage_id}/stats", timeout=10)
        r.raise_for_status()
        return r.json()

    def process_tree(self) -> list[int]:
        """Stage processes (as /health reports them) and every descendant of the server."""
        import psutil

        stages = list(httpx.get(f"{self.base_url}/health", timeout=10).json()["pids"].values())
        tree = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        assert set(stages) <= set(tree), (stages, tree)
        return tree

    def terminate(self) -> None:
        """SIGTERM, once (serve's graceful stop)."""
        if self.proc.poll() is None and not getattr(self, "_terminated", False):
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def stop_all(servers: dict[str, "Server"]) -> dict[str, int]:
    """Stop servers side by side: SIGTERM to each, then wait for each (one by one took ~17 s)."""
    for s in servers.values():
        s.terminate()
    return {name: s.stop() for name, s in servers.items()}


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    from omni_server.models.tiny_checkpoints import ensure_all

    return ensure_all(MODELS)


@pytest.fixture(scope="session")
def record_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stage-inputs")


@pytest.fixture(scope="session")
def servers(request, tiny_models, record_dir, tmp_path_factory):
    """The test servers this session's tests use, started in parallel (engine start dominates)."""
    import torch

    logs = tmp_path_factory.mktemp("server-logs")
    specs = {
        "text": (REPO / "tests" / "configs" / "text.yaml", {}, []),
        # The embedded default (speech) pipeline, greedy talker with its codec ids in `omni_outputs`;
        # the thinker may run only 4 tokens ahead of what the talker used (tight backpressure, below
        # the talker's credit chunk of 8: results must not change and nothing may stall).
        "speech": (REPO / "configs" / "default.yaml", {}, [
            "--stage-arg", "talker.output=tokens", "--stage-arg", "talker.stream_window=4",
            "--stage-arg", "talker.default_sampling.temperature=0",
            "--stage-arg", "talker.default_sampling.repetition_penalty=1.0"]),
        "two_stage": (REPO / "tests" / "configs" / "two_stage.yaml", {"OMNI_TEST_RECORD_DIR": str(record_dir)}, []),
        # Its own copy of the default pipeline: lifecycle tests kill its stages.
        "crash": (REPO / "tests" / "configs" / "lifecycle.yaml", {}, []),
        "replicas": (REPO / "tests" / "configs" / "replicas.yaml", {}, []),
        # The text pipeline hearing videos' audio, its prefill cut in steps of 64 tokens (media spans
        # across steps).
        "chunked": (REPO / "tests" / "configs" / "text.yaml", {}, [
            "--stage-arg", "thinker.model_class=qwen2_5_omni.thinker",
            "--stage-arg", "thinker.max_num_batched_tokens=64", "--stage-arg", "thinker.enable_chunked_prefill=true",
            "--stage-arg", 'thinker.limit_mm_per_prompt={"image": 1, "audio": 2, "video": 2}']),
    }
    used = {f for item in request.session.items for f in item.fixturenames}
    specs = {name: spec for name, spec in specs.items() if f"{name}_server" in used}
    # On one GPU, engines must not profile memory at the same time: start the servers one by one.
    one_by_one = torch.cuda.is_available()
    started: dict[str, Server] = {}
    pids: dict[str, list[int]] = {}
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for name, (config, env, args) in specs.items():
            started[name] = Server(config, logs / f"{name}.log", env=env, args=args)
            if one_by_one:
                started[name].wait_ready(deadline)
        for s in started.values():
            s.wait_ready(deadline)
        pids = {name: s.process_tree() for name, s in started.items()}
        yield started
    finally:
        codes = stop_all(started)
    # SIGTERM to `serve` must stop it cleanly and leave no stage process behind.
    assert codes == {name: 0 for name in started}, codes
    alive = [p for ps in pids.values() for p in ps if _alive(p)]
    assert not alive, f"stage processes left running after shutdown: {alive}"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def text_server(servers) -> Server:
    return servers["text"]


@pytest.fixture(scope="session")
def speech_server(servers) -> Server:
    return servers["speech"]


@pytest.fixture(scope="session")
def two_stage_server(servers) -> Server:
    return servers["two_stage"]


@pytest.fixture(scope="session")
def crash_server(servers) -> Server:
    return servers["crash"]


@pytest.fixture(scope="session")
def replicas_server(servers) -> Server:
    return servers["replicas"]


@pytest.fixture(scope="session")
def chunked_server(servers) -> Server:
    return servers["chunked"]
