"""Optional torch-profiler capture of a window of a stage's steps, for finding where step time goes.

Set in a stage's environment (all stages: the `serve` process's; one stage: its `env:` in the YAML)

    OMNI_PROFILE="dir=/tmp/prof,batch=8,skip=20,steps=50[,trace=1]"

The stage counts steps taken with at least `batch` requests running, lets `skip` of them pass
(warm-up), profiles the next `steps` of them (CPU and, on GPUs, CUDA activity) and writes
`DIR/stage<id>-<name>-r<replica>.txt`: the top operators by self device time and by self CPU time
(plus a Chrome trace `.json` with `trace=1`). Off (no cost beyond one check per step) when unset.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "OMNI_PROFILE"


class StepProfiler:
    def __init__(self, out: Path, batch: int = 1, skip: int = 20, steps: int = 50, trace: bool = False):
        self.out, self.batch, self.skip, self.steps, self.trace = out, batch, skip, steps, trace
        self.seen = 0  # qualifying steps so far
        self.profiled = 0
        self.prof: torch.profiler.profile | None = None
        self.t0 = 0.0
        self.done = False
        self.counted = False  # whether `before` counted the current step

    @classmethod
    def from_env(cls, name: str) -> StepProfiler | None:
        """The profiler OMNI_PROFILE asks for, writing to DIR/`name`.txt; None when unset."""
        spec = os.environ.get(ENV)
        if not spec:
            return None
        fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
        if "dir" not in fields:
            raise ValueError(f"{ENV} needs dir=...: {spec!r}")
        Path(fields["dir"]).mkdir(parents=True, exist_ok=True)
        return cls(Path(fields["dir"]) / f"{name}.txt", batch=int(fields.get("batch", 1)),
                   skip=int(fields.get("skip", 20)), steps=int(fields.get("steps", 50)),
                   trace=fields.get("trace", "0") not in ("0", ""))

    def before(self, running: int) -> None:
        """Call before a step with the number of requests running."""
        if self.done or running < self.batch:
            return
        self.seen += 1
        if self.prof is None and self.seen > self.skip:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
            self.t0 = time.perf_counter()
        if self.prof is not None:
            self.profiled += 1
        self.counted = True

    def after(self, served: bool = True) -> None:
        """Call after a step; `served`: whether it computed anything. A step that did not (a
        streaming stage whose requests all wait for input) does not count: in the sixth H200 run
        the talker's c=1 profile was 50 such steps of 0.23 ms."""
        if self.counted and not served:
            self.seen -= 1
            if self.prof is not None:
                self.profiled -= 1
        self.counted = False
        if self.prof is not None and self.profiled >= self.steps:
            self.finish()

    def finish(self) -> None:
        """Stop and write what was captured (also when the stage stops mid-window)."""
        if self.prof is None or self.done:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.stop()
        self.done = True
        events = self.prof.key_averages()
        device = torch.cuda.is_available()
        parts = [f"{self.profiled} steps with >= {self.batch} requests running, {wall * 1e3:.1f} ms wall "
                 f"({wall * 1e3 / max(self.profiled, 1):.2f} ms per step)\n"]
        if device:
            parts.append("by self device time:\n" + events.table(sort_by="self_device_time_total", row_limit=30))
        parts.append("by self CPU time:\n" + events.table(sort_by="self_cpu_time_total", row_limit=30))
        self.out.write_text("\n".join(parts))
        if self.trace:
            self.prof.export_chrome_trace(str(self.out.with_suffix(".json")))
        log.info("profile of %d steps written to %s", self.profiled, self.out)
        self.prof = None


STEP_LOG_ENV = "OMNI_STEP_LOG"


class StepLog:
    """Every step's start, requests running, requests advanced and duration, for reading how step
    time grows with batch size under real traffic (the stats give only sums over a level).

        OMNI_STEP_LOG=/tmp/steps

    appends `start running served ms` lines to DIR/<stage>.steps (start: Unix time, so stages'
    lines line up), after a `# pid N` line per process (a restarted stage appends). Lines are
    written every `flush_every` steps, after `flush_s` seconds, and at the end. Off when unset; a
    write that fails turns it off with a warning (the stage serves on).
    """

    flush_every = 256
    flush_s = 2.0

    def __init__(self, out: Path):
        self.out = out
        self.rows: list[str] = [f"# pid {os.getpid()}\n"]
        self.flushed = time.monotonic()
        self.start = 0.0
        self.running = 0
        self.off = False
        self.flush()  # (an unwritable file fails here, at the stage's start)

    @classmethod
    def from_env(cls, name: str) -> StepLog | None:
        d = os.environ.get(STEP_LOG_ENV)
        if not d:
            return None
        Path(d).mkdir(parents=True, exist_ok=True)
        return cls(Path(d) / f"{name}.steps")

    def before(self, running: int) -> None:
        self.start, self.running = time.time(), running

    def after(self, served: int, seconds: float) -> None:
        """The step's line; `seconds`: its duration as the stage's stats count it (one clock for both)."""
        if self.off:
            return
        self.rows.append(f"{self.start:.4f} {self.running} {served} {seconds * 1e3:.3f}\n")
        if len(self.rows) >= self.flush_every or time.monotonic() - self.flushed > self.flush_s:
            try:
                self.flush()
            except OSError as e:
                log.warning("OMNI_STEP_LOG: cannot write %s (%s); step log off", self.out, e)
                self.off = True
                self.rows.clear()

    def flush(self) -> None:
        self.flushed = time.monotonic()
        if self.rows and not self.off:
            with self.out.open("a") as f:
                f.writelines(self.rows)
            self.rows.clear()

    def finish(self) -> None:
        """The last lines, at the stage's end."""
        try:
            self.flush()
        except OSError as e:
            log.warning("OMNI_STEP_LOG: cannot write %s (%s)", self.out, e)
