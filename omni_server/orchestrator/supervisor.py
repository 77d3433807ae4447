"""`serve`'s watch over its stage processes, five times a second while the api runs: it releases
stages held until the ones before them are ready, says when all are, fails the requests still in
flight when a shutdown is about to give up on them, and restarts a stage process that exits, hangs,
or hangs again in its restart. A stage that cannot start before the server first says ready stops
the whole server instead (`failed` says why).
"""

from __future__ import annotations

import asyncio
import logging
import time

from omni_server.config.schema import PipelineConfig
from omni_server.orchestrator.launcher import Launcher, Unit
from omni_server.orchestrator.orchestrator import HUNG
from omni_server.orchestrator.restarts import LOOPING, RestartPolicy
from omni_server.wire.transport import stage_address

log = logging.getLogger(__name__)

TICK_S = 0.2


class Supervisor:
    def __init__(self, cfg: PipelineConfig, launcher: Launcher, uv, *, after: dict[Unit, list[Unit]],
                 launched: float, started: float, runtime_dir, external: bool, mps, signals: list[str],
                 failed: list[str]):
        """`uv`: the uvicorn.Server (asked to exit; its sockets say the port bound); `after`: the held
        stages and those they wait for; `launched` / `started`: when the stages were launched and the
        command started (time.monotonic()); `signals`: those received while starting; `failed`: where
        the reasons the server could not start go."""
        self.cfg, self.launcher, self.uv = cfg, launcher, uv
        self.after, self.launched, self.started = after, launched, started
        self.runtime_dir, self.external, self.mps = runtime_dir, external, mps
        self.signals, self.failed = signals, failed
        self.waiting = list(after)
        self.announced = False
        # Each stage's own startup_timeout_s, from its launch (a held one's: from its release).
        self.deadline = {u: launched + cfg.stage(u[0]).startup_timeout_s for u in cfg.units() if u not in self.waiting}
        self.restart_at: dict[Unit, float] = {}
        self.restarted: dict[Unit, float] = {}  # restarted and not ready yet: by when they must be
        # Stopping (uvicorn got SIGTERM / Ctrl-C): the requests still in flight just before its
        # graceful shutdown gives up fail with a 503 (uvicorn's own end cancels their tasks: a bare
        # 500 and a traceback each, and streams cut without their end).
        self.give_up_at: float | None = None
        self.gave_up = False
        self.restarts = RestartPolicy()

    async def run(self, state) -> None:
        """Until the server stops, or fails to start (then `uv.should_exit` and `failed` say so)."""
        cfg = self.cfg
        if self.external:  # (nothing to start or hold: `after` is empty)
            log.info("waiting for external stages at %s", ", ".join(
                f"{cfg.unit_name(u)}={stage_address(cfg, u[0], self.runtime_dir, u[1])}" for u in cfg.units()))
        if self.signals:  # (one came after serve's last check, before uvicorn took the signals over)
            log.info("%s while starting: stopping the stages", self.signals[0])
            self.uv.should_exit = True
            return
        while True:
            orch = state.orch
            self._release(orch)
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            # (Before the exits: once /health has said ready, a stage that dies is a crash to
            # restart, not a failed start that stops the server.)
            self._announce(orch)
            self._give_up_on_shutdown(orch, now)
            if not self._exits(orch, now):
                return
            self._kill_hung(orch)
            self._restart_due(orch, now)
            self._kill_hung_restarts(orch, now)
            if not self._in_time(orch):
                return

    def _release(self, orch) -> None:
        ready = set(orch.ready) if orch is not None else set()
        for unit in list(self.waiting):
            if all(e in ready for e in self.after[unit]):
                self.launcher.release(unit)
                self.waiting.remove(unit)
                self.deadline[unit] = time.monotonic() + self.cfg.stage(unit[0]).startup_timeout_s

    def _announce(self, orch) -> None:
        if self.announced or orch is None or not orch.all_ready:
            return
        self.announced = True
        bound = [sock.getsockname()[1] for server in self.uv.servers for sock in server.sockets]
        log.info("all %d stages ready in %.1f s; serving on http://%s:%d%s", len(self.cfg.stages),
                 time.monotonic() - self.started, self.cfg.server.host, bound[0] if bound else self.cfg.server.port,
                 "" if self.external else f" (stages launched {self.launched - self.started:.2f} s after the command)")

    def _give_up_on_shutdown(self, orch, now: float) -> None:
        if not (self.uv.should_exit and self.announced and orch is not None):
            return
        timeout = self.cfg.server.shutdown_timeout_s
        if self.give_up_at is None:
            self.give_up_at = now + timeout - min(1.0, timeout / 2)
        elif now >= self.give_up_at and not self.gave_up:
            self.gave_up = True
            n = orch.fail_all(f"the server is shutting down: the request did not finish within its "
                              f"shutdown_timeout_s ({timeout:g} s)")
            if n:
                log.warning("shutting down: %d request(s) still in flight failed with a 503", n)

    def _exits(self, orch, now: float) -> bool:
        """Stage processes that exited: marked down and due a restart; False: one could not start
        (the server stops)."""
        cfg, launcher = self.cfg, self.launcher
        for unit, code in launcher.exited().items():
            if unit in self.restart_at:
                continue
            name = cfg.unit_name(unit)
            launcher.kill(unit)  # (its children, if it left any)
            why = launcher.failure(unit)
            log.error("stage %d (%s) exited with code %s%s", unit[0], name, code, f": {why}" if why else "")
            if orch is not None:
                orch.mark_down(unit, f"process exited with code {code}")
            if not self.announced:  # a stage that cannot start makes the whole server fail
                if self.mps is not None:  # (e.g. a GPU whose mode MPS does not support)
                    self.failed.append("the stages ran as clients of serve's CUDA MPS daemon (cuda_mps); "
                                       "`--cuda-mps false` starts them without it")
                self.failed.append(f"stage {unit[0]} ({name}) failed to start (exit code {code})"
                                   + (f": {why}" if why else ""))
                self.uv.should_exit = True
                return False
            delay, streak = self.restarts.crashed(unit, now)
            self.restart_at[unit] = now + delay
            log.log(logging.ERROR if streak >= LOOPING else logging.WARNING,
                    "restarting stage %d (%s) in %.0f s (crash %d in a row; the delay doubles up to %.0f s "
                    "and starts again from 1 s once it runs %.0f s)", unit[0], name, delay, streak,
                    self.restarts.max_delay_s, self.restarts.healthy_s)
        return True

    def _kill_hung(self, orch) -> None:
        if orch is None or not self.announced:
            return
        for unit, reason in list(orch.down.items()):
            proc = self.launcher.procs.get(unit)
            if reason.startswith(HUNG) and proc is not None and proc.poll() is None:
                log.error("stage %d (%s) is hung (%s); killing it to restart it", unit[0],
                          self.cfg.unit_name(unit), reason)
                self.launcher.kill(unit)

    def _restart_due(self, orch, now: float) -> None:
        for unit, at in list(self.restart_at.items()):
            if now >= at:
                del self.restart_at[unit]
                self.launcher.start(unit)
                self.restarted[unit] = now + self.cfg.stage(unit[0]).startup_timeout_s
                if orch is not None:
                    orch.restarting(unit)

    def _kill_hung_restarts(self, orch, now: float) -> None:
        for unit, at in list(self.restarted.items()):
            if orch is not None and unit in orch.ready:
                del self.restarted[unit]
            elif now > at and unit not in self.restart_at:
                # (a restart that hangs in its start would leave the stage down for good: killed, it
                # is restarted again after the next delay)
                del self.restarted[unit]
                log.error("stage %d (%s) restarted but not ready within its startup_timeout_s (%g s); "
                          "killing it to restart it", unit[0], self.cfg.unit_name(unit),
                          self.cfg.stage(unit[0]).startup_timeout_s)
                self.launcher.kill(unit)

    def _in_time(self, orch) -> bool:
        """False: a stage was not ready within its startup_timeout_s of the first start (the server stops)."""
        late = [u for u, at in self.deadline.items() if not self.announced and time.monotonic() > at
                and (orch is None or u not in orch.ready)]
        if not late:
            return True
        absent = [f"{self.cfg.unit_name(u)} ({stage_address(self.cfg, u[0], self.runtime_dir, u[1])}; "
                  f"startup_timeout_s {self.cfg.stage(u[0]).startup_timeout_s:g})" for u in late]
        self.failed.append(f"stages not ready in time: {', '.join(absent)}")
        self.uv.should_exit = True
        return False
