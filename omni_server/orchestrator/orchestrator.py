"""Per-request state across stages, in the api process's event loop.

A request enters the stage(s) that read the client's prompt; later stages are told to expect it and
receive their inputs stage to stage. The request is done when every client-facing stage finished.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import zmq
import zmq.asyncio

from omni_server.config.schema import PipelineConfig
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
from omni_server.wire.transport import SEND_HWM, api_address, decode_or_none, stage_address

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
HUNG = "no answer"  # mark_down reason prefix for a stage that stopped answering pings


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


class Orchestrator:
    def __init__(self, cfg: PipelineConfig, runtime_dir: Path):
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.curve = curve_for(cfg.server.curve_keys_dir)
        if self.curve:
            self.curve.start_authenticator(self.ctx)
        self.out = self.ctx.socket(zmq.PULL)
        if self.curve:
            self.curve.server(self.out)
        self.out.bind(api_address(cfg, runtime_dir))
        self.stage_socks: dict[int, zmq.asyncio.Socket] = {}
        for s in cfg.stages:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 1000)
            if self.curve:
                self.curve.client(sock)
            sock.connect(stage_address(cfg, s.id, runtime_dir))
            self.stage_socks[s.id] = sock
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.output_stages = {s.id for s in cfg.stages if s.output}
        self.requests: dict[str, RequestState] = {}
        self.ready: dict[int, StageReady] = {}
        self.down: dict[int, str] = {}
        self.last_seen: dict[int, float] = {}
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
            await asyncio.sleep(PROBE_INTERVAL_S)
            now = time.monotonic()
            for s in self.cfg.stages:
                silent = now - self.last_seen.get(s.id, now)
                if s.id in self.ready and silent > timeout:
                    log.error("stage %d (%s) has not answered for %.0f s", s.id, s.name, silent)
                    self.mark_down(s.id, f"{HUNG} for {silent:.0f} s")
                if s.id not in self.ready or silent >= PROBE_INTERVAL_S:
                    try:
                        await self._send(self.stage_socks[s.id], StatsQuery(nonce=0))
                    except zmq.ZMQError:
                        pass

    def _on_ready(self, msg: StageReady) -> None:
        self.last_seen[msg.stage_id] = time.monotonic()
        self.ready[msg.stage_id] = msg
        self.down.pop(msg.stage_id, None)
        log.info("stage %d (%s) ready: engine start %.1f s, %.1f s since the api started", msg.stage_id,
                 self.cfg.stage(msg.stage_id).name, msg.startup_s, time.monotonic() - self.started_at)
        if self.all_ready:
            self._ready_event.set()

    @property
    def all_ready(self) -> bool:
        return len(self.ready) == len(self.cfg.stages) and not self.down

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    def mark_down(self, stage_id: int, reason: str) -> None:
        """A stage process died: fail every request in flight (they all pass through every stage)."""
        self.down[stage_id] = reason
        self.ready.pop(stage_id, None)
        for state in list(self.requests.values()):
            self._push(state, stage_id, RequestDelta(
                request_id=state.request_id, finished=True, finish_reason="error",
                error=f"stage {self.cfg.stage(stage_id).name} is unavailable: {reason}", error_code=503))

    async def close(self) -> None:
        # Stages are not told to stop: `serve` stops the ones it started, external ones outlive the api.
        for task in (self._recv_task, self._probe_task):
            if task:
                task.cancel()
        if self.curve:
            self.curve.stop()
        self.ctx.destroy(linger=500)

    # ---- requests ---------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_token_ids: list[int], sampling: dict[int, SamplingSpec],
                     outputs: set[str] | None = None, options: dict[str, str] | None = None,
                     media: dict | None = None) -> RequestState:
        """Start a request on the stages its `outputs` kinds need (None: every output stage).
        Stages with `output: tokens` report whenever the route passes through them."""
        if self.down:
            raise StageUnavailable(", ".join(f"stage {i}: {r}" for i, r in self.down.items()))
        if not self.all_ready:
            raise StageUnavailable("the pipeline is still starting")
        kinds = outputs if outputs is not None else {self.cfg.stage(i).output for i in self.output_stages}
        route = self.cfg.route(kinds)
        wanted = {i for i in route if self.cfg.stage(i).output in kinds or self.cfg.stage(i).output == "tokens"}
        state = RequestState(request_id, set(wanted), outputs=set(wanted))
        self.requests[request_id] = state
        opts = dict(options or {})
        # Downstream stages first, so they know the request before payloads arrive (either order works).
        for i in reversed(route):
            s = self.cfg.stage(i)
            fwd = [c for c in self.cfg.consumers(i) if c in route]
            if s.inputs:
                msg: Message = ExpectRequest(request_id=request_id, sampling=sampling[i], sources=list(s.inputs),
                                             forward_to=fwd, options=opts)
            else:
                msg = AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling[i],
                                 forward_to=fwd, options=opts, tensors=dict(media or {}))
            await self._send(self.stage_socks[i], msg)
        return state

    async def deltas(self, state: RequestState) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Yield (stage id, delta) until every client-facing stage finished or one failed."""
        try:
            while not state.done:
                stage_id, delta = await state.queue.get()
                if delta.error is not None or (delta.finished and stage_id not in state.outputs
                                               and delta.finish_reason in ("abort", "error")):
                    state.done = True
                    # The other stages may still hold it (running, or expecting its input): drop it there.
                    await self.abort(state.request_id)
                    yield stage_id, delta
                    return
                if stage_id in state.outputs:
                    if delta.finished:
                        state.pending.discard(stage_id)
                        state.done = not state.pending
                    yield stage_id, delta
        finally:
            self.requests.pop(state.request_id, None)

    async def finish(self, request_id: str, stage_id: int) -> None:
        """Cut one stage's generation short; stages downstream still get its output so far."""
        await self._send(self.stage_socks[stage_id], FinishRequest(request_id=request_id))

    async def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        msg = AbortRequest(request_ids=[request_id])
        for sock in self.stage_socks.values():
            await self._send(sock, msg)

    async def stats(self, stage_id: int, timeout: float = 5.0) -> StageStats:
        nonce = next(self._nonce)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = fut
        try:
            await self._send(self.stage_socks[stage_id], StatsQuery(nonce=nonce))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats_waiters.pop(nonce, None)

    # ---- transport --------------------------------------------------------------------------

    async def _send(self, sock: zmq.asyncio.Socket, msg: Message) -> None:
        await sock.send_multipart(self.encoder.encode(msg), copy=False)

    def _push(self, state: RequestState, stage_id: int, delta: RequestDelta) -> None:
        state.queue.put_nowait((stage_id, delta))

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.out.recv_multipart(copy=False)
            msg = decode_or_none(self.decoder, frames, "api")
            stage_id = getattr(msg, "stage_id", None)
            if stage_id in self.stage_socks:
                self.last_seen[stage_id] = time.monotonic()
            if isinstance(msg, RequestOutputs):
                for delta in msg.deltas:
                    state = self.requests.get(delta.request_id)
                    if state is not None:
                        self._push(state, msg.stage_id, delta)
            elif isinstance(msg, StageStats):
                if msg.nonce == 0:  # a probe's answer
                    if msg.stage_id in self.stage_socks and msg.stage_id not in self.ready:
                        self._on_ready(StageReady(stage_id=msg.stage_id, pid=msg.pid, startup_s=msg.startup_s,
                                                  info=msg.info))
                    continue
                fut = self._stats_waiters.get(msg.nonce)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, StageReady):
                if 0 <= msg.stage_id < len(self.cfg.stages):
                    self._on_ready(msg)
            elif msg is not None:
                log.warning("api: ignoring unexpected %s", type(msg).__name__)
