"""A private CUDA MPS daemon for the stage processes `serve` starts (config `cuda_mps`).

Processes sharing a GPU time-slice it: one process's kernels at a time. Under MPS (NVIDIA's
Multi-Process Service) their kernels run side by side: on the H200 the 7B pipeline on one GPU went
from 1048 to 897 ms first audio at c=16 and from 0.263 to 0.208 RTF at c=1 (BENCHMARKS.md, ninth
run). The daemon is this server's own: its pipe directory lies in the runtime dir, so it needs no
system-wide daemon, leaves other processes' GPU use alone, and stops with the server, even one
killed outright (a watchdog process quits it then).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

PROGRAM = "nvidia-cuda-mps-control"  # installed with the NVIDIA driver


class MPSError(RuntimeError):
    pass


class MPSDaemon:
    def __init__(self, directory: Path):
        # Clients find the daemon by these two variables; the pipe directory holds its sockets.
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": str(directory / "log")}
        self.program: str | None = None
        self.watchdog: subprocess.Popen | None = None

    def _env(self) -> dict[str, str]:
        # Without CUDA_VISIBLE_DEVICES the daemon sees every GPU, so the stages' own settings (GPU
        # indices as the host numbers them) mean the same to it as without MPS.
        return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | self.env

    def _run(self, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.program or PROGRAM, *args], env=self._env(), input=stdin, capture_output=True,
                              timeout=30)

    def start(self) -> None:
        self.program = shutil.which(PROGRAM)
        if self.program is None:
            raise MPSError(f"{PROGRAM} is not on PATH (it comes with the NVIDIA driver)")
        for d in self.env.values():
            os.makedirs(d, mode=0o700, exist_ok=True)
        try:
            done = self._run("-d")  # (forks the daemon and returns)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MPSError(f"{PROGRAM} -d: {e}") from None
        if done.returncode != 0:
            why = " ".join((done.stderr or done.stdout).decode(errors="replace").split())[:300]
            raise MPSError(f"{PROGRAM} -d exited with code {done.returncode}" + (f": {why}" if why else ""))
        # The watchdog quits the daemon once this process is gone, however it ended (`stop` ends
        # the watchdog first).
        watch = f'while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; echo quit | "$0"'
        self.watchdog = subprocess.Popen(["sh", "-c", watch, self.program], env=self._env(), start_new_session=True,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
        log.info("CUDA MPS daemon started (pipe directory %s)", self.env["CUDA_MPS_PIPE_DIRECTORY"])

    def stop(self) -> None:
        """Quit the daemon (and the MPS server it ran); after the stage processes have exited."""
        if self.program is None:
            return
        if self.watchdog is not None:
            self.watchdog.kill()
            self.watchdog.wait()
            self.watchdog = None
        try:
            done = self._run(stdin=b"quit\n")
            if done.returncode != 0:
                log.warning("CUDA MPS daemon did not quit (exit code %d)", done.returncode)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("CUDA MPS daemon did not quit: %s", e)
        self.program = None
