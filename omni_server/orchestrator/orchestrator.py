"""Per-request state across stages, in the api process's event loop.

A request enters the stage(s) that read the client's prompt; later stages are told to expect it and
receive their inputs stage to stage. The request is done when every client-facing stage finished.
A stage may run several replicas (engine processes): each request goes to the ready replica of each
stage with the fewest requests in flight, and every stage on its route learns those choices.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterable

import zmq
import zmq.asyncio

from omni_server.config.schema import PipelineConfig
from omni_server.orchestrator.metrics import Metrics
from omni_server.wire.codec import Decoder, Encoder
from omni_server.wire.messages import (
    AbortRequest,
    AddRequest,
    ExpectRequest,
    FinishRequest,
    Message,
    RequestDelta,
    RequestOutputs,
    SamplingSpec,
    StageReady,
    StageStats,
    StatsQuery,
)
from omni_server.wire.security import curve_for
from omni_server.wire.transport import SEND_HWM, api_address, decode_or_none, input_socket, stage_address

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
# A probe tick this much later than due: the api stalled (its own silence is not the stages').
STALL_S = 1.0
HUNG = "no answer"  # mark_down reason prefix for a stage that stopped answering pings
RESTARTING = "restarting"  # down reason prefix for a stage whose new process is starting


Unit = tuple[int, int]  # (stage id, replica): one engine process


class StageUnavailable(RuntimeError):
    """A stage the request needs is not running."""


@dataclass
class RequestState:
    request_id: str
    # Client-facing stages that have not finished yet.
    pending: set[int]
    # Client-facing stages on this request's route.
    outputs: set[int] = field(default_factory=set)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False
    # Stage id -> the replica serving this request, for every stage on its route.
    replicas: dict[int, int] = field(default_factory=dict)
    # Stages on its route that finished it (their part done: a later death there does not fail it).
    finished: set[int] = field(default_factory=set)
    # Its last client-facing delta arrived (or a failure): the pipeline's work for it is over, however
    # slowly its client reads (the concurrency limit counts only requests not `over`).
    over: bool = False
    released: bool = False  # its replicas' load counts were given back
    # For metrics: when it was submitted, whether text / audio came yet, how it ended (once).
    t0: float = 0.0
    first_text: bool = False
    first_audio: bool = False
    got_audio: bool = False  # an audio stage sent an audio tensor (even an empty one)
    outcome: str | None = None
    counted: bool = False


class Orchestrator:
    def __init__(self, cfg: PipelineConfig, runtime_dir: Path):
        self.cfg = cfg
        self.metrics = Metrics(cfg.model)
        self.ctx = zmq.asyncio.Context()
        self.closed = False  # (close() ran: sends are dropped)
        self.curve = curve_for(cfg.server.curve_keys_dir)
        if self.curve:
            self.curve.start_authenticator(self.ctx)
        self.out = input_socket(self.ctx, self.curve, api_address(cfg, runtime_dir))
        self.units = cfg.units()
        self.stage_socks: dict[Unit, zmq.asyncio.Socket] = {}
        for unit in self.units:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 1000)
            if self.curve:
                self.curve.client(sock)
            sock.connect(stage_address(cfg, unit[0], runtime_dir, unit[1]))
            self.stage_socks[unit] = sock
        self.load: dict[Unit, int] = {u: 0 for u in self.units}  # requests in flight per replica
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.output_stages = {s.id for s in cfg.stages if s.output}
        self.requests: dict[str, RequestState] = {}
        self.ready: dict[Unit, StageReady] = {}
        self.down: dict[Unit, str] = {}
        self.last_seen: dict[Unit, float] = {}
        self._ready_event = asyncio.Event()
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._nonce = itertools.count(1)
        self._recv_task: asyncio.Task | None = None
        self._probe_task: asyncio.Task | None = None
        self.started_at = time.monotonic()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._recv_task = loop.create_task(self._recv_loop())
        self._probe_task = loop.create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        """Ping every stage each second (stats with nonce 0). An answer from a stage that is not
        ready makes it ready: a stage started before the api (by hand, docker) sent its StageReady
        to nobody. A ready stage silent for `stage_timeout_s` (hung, or an external stage that died)
        is marked down, failing its requests; it comes back when it answers again."""
        timeout = self.cfg.server.stage_timeout_s
        while True:
            slept = time.monotonic()
            await asyncio.sleep(PROBE_INTERVAL_S)
            now = time.monotonic()
            stalled = now - slept - PROBE_INTERVAL_S
            if stalled > STALL_S:
                # The api itself stood still (a paused container, a blocked loop): the stages' answers
                # wait unread in its socket and no probe went out. That time is not their silence.
                for unit in self.last_seen:
                    self.last_seen[unit] += stalled
            for unit in self.units:
                silent = now - self.last_seen.get(unit, now)
                if unit in self.ready and silent > timeout:
                    log.error("stage %d (%s) has not answered for %.0f s", unit[0], self.cfg.unit_name(unit), silent)
                    self.mark_down(unit, f"{HUNG} for {silent:.0f} s")
                if unit not in self.ready or silent >= PROBE_INTERVAL_S:
                    await self._send_or_drop(unit, StatsQuery(nonce=0))

    def _on_ready(self, msg: StageReady) -> None:
        unit = (msg.stage_id, msg.replica)
        before = self.ready.get(unit)
        if before is not None and before.boot != msg.boot:
            # A new process answers at the address (an external stage restarted by docker, say,
            # within stage_timeout_s): the requests the old one held are gone with it.
            log.error("stage %d (%s) restarted (pid %d -> %d)", msg.stage_id, self.cfg.unit_name(unit),
                      before.pid, msg.pid)
            self.mark_down(unit, "the stage process restarted")
        self.last_seen[unit] = time.monotonic()
        self.ready[unit] = msg
        self.down.pop(unit, None)
        log.info("stage %d (%s) ready: engine start %.1f s, %.1f s since the api started", msg.stage_id,
                 self.cfg.unit_name(unit), msg.startup_s, time.monotonic() - self.started_at)
        if self.all_ready:
            self._ready_event.set()

    @property
    def all_ready(self) -> bool:
        return len(self.ready) == len(self.units) and not self.down

    @property
    def serving(self) -> bool:
        """Every stage was ready once and has a ready replica now."""
        return self._ready_event.is_set() and self.unavailable() is None

    def unavailable(self, stage_ids: Iterable[int] | None = None) -> str | None:
        """Why some stage (of `stage_ids`; None: of the pipeline) has no ready replica (None: each has one)."""
        reasons = []
        for s in self.cfg.stages:
            if stage_ids is not None and s.id not in stage_ids:
                continue
            units = [(s.id, r) for r in range(s.replicas)]
            if not any(u in self.ready for u in units):
                down = [f"{self.cfg.unit_name(u)}: {self.down[u]}" for u in units if u in self.down]
                reasons.append("; ".join(down) or f"stage {s.name} is starting")
        return ", ".join(reasons) or None

    def stage_info(self, stage_id: int) -> StageReady | None:
        """The StageReady of a ready replica of this stage (facts like a generator's voices)."""
        return next((self.ready[(stage_id, r)] for r in range(self.cfg.stage(stage_id).replicas)
                     if (stage_id, r) in self.ready), None)

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    def mark_down(self, unit: Unit, reason: str) -> None:
        """A stage process died: fail the requests in flight that it serves, but those it finished
        whose consumers on the route finished too (they hold all it sent, e.g. a reply's audio still
        streaming from the last stage when the first one dies; a consumer still running may lack
        a payload the dead process had queued)."""
        stage_id, replica = unit
        self.down[unit] = reason
        self.ready.pop(unit, None)
        for state in list(self.requests.values()):
            if state.replicas.get(stage_id) != replica:
                continue
            consumers = [c for c in self.cfg.consumers(stage_id) if c in state.replicas]
            if not all(s in state.finished for s in [stage_id, *consumers]):
                self._push(state, stage_id, RequestDelta(
                    request_id=state.request_id, finished=True, finish_reason="error",
                    error=f"stage {self.cfg.unit_name(unit)} is unavailable: {reason}", error_code=503))

    def fail_all(self, reason: str) -> int:
        """Fail every request the pipeline still works on with a 503 (the api stopping at its
        shutdown deadline: each client gets an answer or an error event, not a cut connection);
        how many."""
        failed = 0
        for state in list(self.requests.values()):
            if state.over or not state.pending:
                continue
            failed += 1
            self._push(state, min(state.pending), RequestDelta(
                request_id=state.request_id, finished=True, finish_reason="error", error=reason, error_code=503))
        return failed

    def restarting(self, unit: Unit) -> None:
        """`serve` started a new process for a stage that is down (/health: "restarting")."""
        self.down[unit] = f"{RESTARTING} ({self.down.get(unit, 'down')})"

    async def close(self) -> None:
        # Stages are not told to stop: `serve` stops the ones it started, external ones outlive the api.
        for task in (self._recv_task, self._probe_task):
            if task:
                task.cancel()
        if self.curve:
            self.curve.stop()
        self.closed = True
        self.ctx.destroy(linger=500)

    # ---- requests ---------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_token_ids: list[int], sampling: dict[int, SamplingSpec],
                     outputs: set[str] | None = None, options: dict[str, str] | None = None,
                     media: dict | None = None) -> RequestState:
        """Start a request on the stages its `outputs` kinds need (None: every output stage).
        Stages with `output: tokens` report whenever the route passes through them."""
        if not self._ready_event.is_set():
            raise StageUnavailable("the pipeline is still starting")
        kinds = outputs if outputs is not None else {self.cfg.stage(i).output for i in self.output_stages}
        route = self.cfg.route(kinds)
        why = self.unavailable(route)  # (a stage off its route may be down: text needs no vocoder)
        if why:
            raise StageUnavailable(why)
        wanted = {i for i in route if self.cfg.stage(i).output in kinds or self.cfg.stage(i).output == "tokens"}
        replicas = {i: self._least_loaded(i) for i in route}
        state = RequestState(request_id, set(wanted), outputs=set(wanted), replicas=replicas, t0=time.monotonic())
        for unit in replicas.items():
            self.load[unit] += 1
        self.requests[request_id] = state
        opts = dict(options or {})
        # Downstream stages first, so they know the request before payloads arrive (either order works).
        for i in reversed(route):
            s = self.cfg.stage(i)
            fwd = [c for c in self.cfg.consumers(i) if c in route]
            if s.inputs:
                msg: Message = ExpectRequest(request_id=request_id, sampling=sampling[i], sources=list(s.inputs),
                                             forward_to=fwd, options=opts, replicas=replicas)
            else:
                msg = AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling[i],
                                 forward_to=fwd, options=opts, tensors=dict(media or {}), replicas=replicas)
            await self._send(self.stage_socks[(i, replicas[i])], msg)
        return state

    def _least_loaded(self, stage_id: int) -> int:
        ready = [r for r in range(self.cfg.stage(stage_id).replicas) if (stage_id, r) in self.ready]
        return min(ready, key=lambda r: (self.load[(stage_id, r)], r))

    def _release(self, state: RequestState) -> None:
        if not state.released:
            state.released = True
            for unit in state.replicas.items():
                self.load[unit] -= 1

    async def deltas(self, state: RequestState) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Yield (stage id, delta) until every client-facing stage finished or one failed."""
        try:
            while not state.done:
                stage_id, delta = await state.queue.get()
                if delta.error is not None or (delta.finished and stage_id not in state.outputs
                                               and delta.finish_reason in ("abort", "error")):
                    # (a request a stage refused as the client's error is no fault of the server's)
                    state.done, state.outcome = True, "invalid" if delta.error_code == 400 else "error"
                    # The other stages may still hold it (running, or expecting its input): drop it there.
                    await self.abort(state.request_id)
                    self._close(state)
                    yield stage_id, delta
                    return
                if stage_id in state.outputs:
                    if delta.finished:
                        state.pending.discard(stage_id)
                        state.done = not state.pending
                    self._observe(state, stage_id, delta)
                    if state.done:
                        # Closed before the last delta goes out: a consumer that never resumes this
                        # generator (its client gone) would run the `finally` only when the garbage
                        # collector finds it (the api's stream and its run form a cycle).
                        self._close(state)
                    yield stage_id, delta
        finally:
            self._close(state)

    def _close(self, state: RequestState) -> None:
        """Forget a request that ended or was left: its load, its metrics outcome (once)."""
        self.requests.pop(state.request_id, None)
        self._release(state)
        outcome = state.outcome or ("ok" if state.done else "aborted")
        if outcome == "ok" and not state.got_audio and any(self.cfg.stage(i).output == "audio" for i in state.outputs):
            outcome = "error"  # (the api answers "the pipeline returned no audio": a 500)
        self._end(state, outcome)

    def _observe(self, state: RequestState, stage_id: int, delta: RequestDelta) -> None:
        kind = self.cfg.stage(stage_id).output
        if kind == "text" and delta.new_token_ids and not state.first_text:
            state.first_text = True
            self.metrics.ttft.observe(time.monotonic() - state.t0)
        wave = delta.tensors.get("audio") if kind == "audio" else None
        state.got_audio = state.got_audio or wave is not None
        if wave is not None and len(wave):
            if not state.first_audio:
                state.first_audio = True
                self.metrics.ttfp.observe(time.monotonic() - state.t0)
            if delta.sample_rate:
                self.metrics.audio.inc(len(wave) / delta.sample_rate)

    def _end(self, state: RequestState, outcome: str) -> None:
        if not state.counted:
            state.counted = True
            self.metrics.ended(state.t0, outcome)

    async def finish(self, request_id: str, stage_id: int, keep: int = -1) -> None:
        """Cut one stage's generation short; stages downstream still get its output so far (its
        first `keep` tokens; -1: all)."""
        state = self.requests.get(request_id)
        replica = state.replicas.get(stage_id, 0) if state else 0
        await self._send_or_drop((stage_id, replica), FinishRequest(request_id=request_id, keep=keep))

    async def abort(self, request_id: str, outcome: str = "aborted") -> None:
        """Drop the request in every stage; `outcome` for metrics ("ok": it ended early by design)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._release(state)
            self._end(state, state.outcome or outcome)
        msg = AbortRequest(request_ids=[request_id])
        # The request's own route (every replica when it is no longer known here).
        units = list(state.replicas.items()) if state is not None else list(self.stage_socks)
        for unit in units:
            await self._send_or_drop(unit, msg)

    async def stats(self, stage_id: int, replica: int = 0, timeout: float = 5.0) -> StageStats:
        nonce = next(self._nonce)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = fut
        try:
            await self._send_or_drop((stage_id, replica), StatsQuery(nonce=nonce))  # (a down one reads nothing)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats_waiters.pop(nonce, None)

    # ---- transport --------------------------------------------------------------------------

    async def _send(self, sock: zmq.asyncio.Socket, msg: Message, flags: int = 0) -> None:
        await sock.send_multipart(self.encoder.encode(msg), copy=False, flags=flags)

    async def _send_or_drop(self, unit: Unit, msg: Message) -> None:
        """Send without waiting for room: a stage that is down (or one that stays down: a replica
        given up, an external stage gone) reads nothing, its queue fills to SEND_HWM, and a blocking
        send would then stall the caller for good (an abort in a failing request's path, the probes).
        Once closed (the api stopping), nothing: the streams its shutdown cancels still abort theirs."""
        if self.closed:
            return
        try:
            await self._send(self.stage_socks[unit], msg, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("api: %s to %s dropped: its queue is full", type(msg).__name__, self.cfg.unit_name(unit))
        except zmq.ZMQError as e:
            log.warning("api: %s to %s failed: %s", type(msg).__name__, self.cfg.unit_name(unit), e)

    def _push(self, state: RequestState, stage_id: int, delta: RequestDelta) -> None:
        if delta.finished and delta.error is None and delta.finish_reason not in ("abort", "error"):
            state.finished.add(stage_id)
        elif delta.error is not None or delta.finished:
            state.over = True  # (failed or aborted somewhere on its route)
        state.over = state.over or state.outputs <= state.finished
        state.queue.put_nowait((stage_id, delta))

    def in_flight(self) -> int:
        """Requests the pipeline still works on (not those whose client has yet to read the end)."""
        return sum(1 for state in self.requests.values() if not state.over)

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.out.recv_multipart(copy=False)
            msg = decode_or_none(self.decoder, frames, "api")
            unit = (getattr(msg, "stage_id", None), getattr(msg, "replica", 0))
            if isinstance(msg, (StageStats, StageReady)) and unit in self.stage_socks:
                self.last_seen[unit] = time.monotonic()
            if isinstance(msg, RequestOutputs):
                for delta in msg.deltas:
                    state = self.requests.get(delta.request_id)
                    if state is not None:
                        self._push(state, msg.stage_id, delta)
            elif isinstance(msg, StageStats):
                if msg.nonce == 0:  # a probe's answer
                    if unit in self.stage_socks and (unit not in self.ready or self.ready[unit].boot != msg.boot):
                        self._on_ready(StageReady(stage_id=msg.stage_id, pid=msg.pid, startup_s=msg.startup_s,
                                                  info=msg.info, replica=msg.replica, boot=msg.boot))
                    continue
                fut = self._stats_waiters.get(msg.nonce)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, StageReady):
                if unit in self.stage_socks:
                    self._on_ready(msg)
            elif msg is not None:
                log.warning("api: ignoring unexpected %s", type(msg).__name__)
