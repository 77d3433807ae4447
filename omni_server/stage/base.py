"""What every stage process does around its engine: the input socket and per-request bookkeeping.

Loop: drain the input socket (add / expect / payload / abort / stats / shutdown), then let the
engine do one step if it has work. A request with upstream inputs starts once the api announced it
(ExpectRequest) and every source's payload arrived; the stage's input processor turns those payloads
into the engine's input. Subclasses (AR, generation) implement the engine side.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from omni_server.config.schema import PipelineConfig
from omni_server.stage import processors
from omni_server.stage.errors import RequestError, server_fault
from omni_server.stage.processors import StageInput
from omni_server.stage.profiling import StepLog, StepProfiler
from omni_server.wire.messages import (
    AbortRequest,
    AddRequest,
    FinishRequest,
    ExpectRequest,
    RequestDelta,
    RequestOutputs,
    Shutdown,
    StagePayload,
    StageReady,
    StageStats,
    StatsQuery,
    StreamCredit,
)
from omni_server.wire.transport import StageSockets

log = logging.getLogger(__name__)

# Payloads that arrived before their ExpectRequest are kept, but not without bound: in count, in
# bytes, and in time (the api announces a request to its consumers before its producer even gets
# it, so a payload's ExpectRequest is ms behind it if at all; one that never comes, e.g. for the
# requests a restarted consumer's old process held, would otherwise keep the payload for good).
MAX_ORPHAN_PAYLOADS = 1024
MAX_ORPHAN_BYTES = 1 << 30
ORPHAN_TTL_S = 30.0
# Ids of aborted/failed requests remembered, so payloads still in flight for them are dropped.
MAX_TOMBSTONES = 16384
# Requests whose replica choices are remembered (far more than can be in flight).
MAX_ROUTES = 65536
# How long the loop waits on its socket once two steps in a row advanced nothing (see run).
IDLE_POLL_MS = 5
# ... and at most this long while a request is prepared off the loop (it enters the engine when done).
BACKGROUND_POLL_MS = 2


@dataclass
class _Waiting:
    """A request announced by the api whose upstream payloads are not all here yet (or, for a
    streamed input, the chunks received so far, merged per source)."""

    expect: ExpectRequest | None = None
    payloads: dict[int, StagePayload] = field(default_factory=dict)
    started: bool = False
    since: float = field(default_factory=time.monotonic)  # when its first message came
    # Streamed tensors per (source, name): a buffer with room to grow, and the rows in it. The
    # merged payload holds views of the filled part (concatenating every chunk onto the whole so
    # far would copy a long prompt's hidden rows once per chunk).
    _grown: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def merge(self, chunk: StagePayload) -> None:
        src = chunk.source_stage
        old = self.payloads.get(src)
        if old is None:
            self.payloads[src] = chunk
            return
        tensors = dict(old.tensors)
        for key, value in chunk.tensors.items():
            tensors[key] = self._append(src, key, tensors[key], value) if key in tensors else value
        self.payloads[src] = StagePayload(
            request_id=old.request_id, source_stage=src, prompt_token_ids=old.prompt_token_ids,
            output_token_ids=old.output_token_ids + chunk.output_token_ids, tensors=tensors, final=chunk.final)

    def _append(self, src: int, key: str, have: torch.Tensor, more: torch.Tensor) -> torch.Tensor:
        """`have` + `more` along dim 0, amortised: rows are copied once, plus on each doubling."""
        if more.shape[1:] != have.shape[1:] or more.dtype != have.dtype:
            raise ValueError(f"{key}: a chunk of {tuple(more.shape)} {more.dtype} "
                             f"after {tuple(have.shape)} {have.dtype}")
        buf = self._grown.get((src, key))
        n, m = len(have), len(more)
        if buf is None or n + m > len(buf):
            buf = torch.empty((max(2 * (n + m), 64), *have.shape[1:]), dtype=have.dtype, device=have.device)
            buf[:n] = have
            self._grown[(src, key)] = buf
        buf[n:n + m] = more
        return buf[:n + m]

    def nbytes(self) -> int:
        return sum(t.nbytes for p in self.payloads.values() for t in p.tensors.values()
                   if isinstance(t, torch.Tensor))

    def complete(self) -> bool:
        return self.expect is not None and all(
            src in self.payloads and self.payloads[src].final for src in self.expect.sources)


class Stage:
    # A loop that spends longer than this between engine steps (draining messages, building
    # inputs) says so in the log: its requests' outputs waited that long.
    slow_loop_s = 1.0

    def __init__(self, cfg: PipelineConfig, stage_id: int, sockets: StageSockets):
        self.cfg = cfg
        self.stage_id = stage_id
        self.stage = cfg.stage(stage_id)
        self.sockets = sockets
        self.processor = processors.get(self.stage.input_processor) if self.stage.input_processor else None
        self.waiting: dict[str, _Waiting] = {}
        self._dirty: dict[str, None] = {}  # requests with new input since the last loop
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.replica = sockets.replica
        self.boot = secrets.randbits(63) | 1  # this process's StageReady.boot (os entropy: fork-safe)
        # request id -> the replica of each stage on its route that serves it (payloads, credits).
        self.routes: OrderedDict[str, dict[int, int]] = OrderedDict()
        self.steps = 0
        # Profiling counters: seconds spent in step(), the steps that advanced a request and the
        # requests they advanced, summed (their deltas over a bench level give the mean step time,
        # busy fraction and batch size; a step that only flushes finished requests adds its time).
        self.step_s = 0.0
        self.batch_sum = 0
        self.backpressure_pauses = 0
        # Streamed audio that reached the api after its listener's audio ran out (a player that
        # starts at the first piece, real time): pieces and seconds of pause (generation stages).
        self.underruns = 0
        self.underrun_s = 0.0
        self.cached_tokens = 0  # prompt tokens the prefix cache spared (AR stages)
        self.payload_bytes = 0
        # Arrival time of each request not yet past its first output (a per-stage timeline: with
        # every stage told of a request at its start, the mean delay shows which stage holds it).
        self.arrived: OrderedDict[str, float] = OrderedDict()
        self.first_outputs = 0
        self.first_output_s = 0.0
        self.running = True
        self.startup_s = 0.0
        # Streamed inputs (consumer side of backpressure): the use last reported to each request's
        # sources, and the requests that told them they wait for input (until more arrives).
        self.credited: dict[str, int] = {}
        self.starved: set[str] = set()

    # ---- engine side (subclasses) ----------------------------------------------------------

    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> int:
        """Advance the stage one step; how many requests it advanced (the batch statistic)."""
        raise NotImplementedError

    def add_prompt(self, msg: AddRequest) -> None:
        self.fail(msg.request_id, f"stage {self.stage.name} takes no client prompt", code=400)

    def start(self, expect: ExpectRequest, stage_input: StageInput, final: bool = True) -> None:
        """Begin the request; `final` False: its input is streamed and still growing (extend)."""
        raise NotImplementedError

    def extend(self, request_id: str, stage_input: StageInput, final: bool) -> None:
        """A streamed input grew after the request started: the processor's input built from
        everything received so far, and whether the input is complete now."""
        raise NotImplementedError(f"stage {self.stage.name} cannot take streamed input")

    def step_rows_given(self, request_id: str) -> int:
        """Per-step input rows a started streamed request holds (an incremental processor's `since`)."""
        return 0

    def drop(self, request_ids: list[str]) -> None:
        """Remove these requests from the engine (aborted or failed)."""

    def credit(self, msg: StreamCredit) -> None:
        """A streaming consumer used more of a request's output (producers only)."""

    def report_use(self, request_id: str, sources: list[int], used: int, waiting: bool) -> None:
        """Credit a streamed input's sources every `stream_chunk` input tokens used, and once each
        time the request cannot step without more input (`waiting`: its sources must then send
        more whatever their window; `input_arrived` re-arms it)."""
        waiting = waiting and request_id not in self.starved
        if waiting or used - self.credited.get(request_id, 0) >= self.stage.stream_chunk:
            self.credited[request_id] = used
            if waiting:
                self.starved.add(request_id)
            self.send_credit(request_id, sources, used, waiting=waiting)

    def input_arrived(self, request_id: str) -> None:
        self.starved.discard(request_id)

    def forget_use(self, request_id: str) -> None:
        self.credited.pop(request_id, None)
        self.starved.discard(request_id)

    def send_credit(self, request_id: str, sources: list[int], consumed: int, waiting: bool = False) -> None:
        """Tell this request's streaming sources how much of their output was used (-1: no more
        needed), and whether the request waits for more (see StreamCredit)."""
        msg = StreamCredit(request_id=request_id, stage_id=self.stage_id, consumed=consumed, waiting=waiting)
        for src in sources:
            self.send_stage(src, request_id, msg)

    def send_stage(self, stage_id: int, request_id: str, msg) -> None:
        """To the replica of `stage_id` that serves this request."""
        if isinstance(msg, StagePayload):
            self.payload_bytes += sum(t.numel() * t.element_size() for t in msg.tensors.values())
            self._output_sent(request_id)
        self.sockets.send_stage(stage_id, msg, self.routes.get(request_id, {}).get(stage_id, 0))

    def send_outputs(self, deltas: list[RequestDelta]) -> None:
        """Deltas for the api (client-facing output, ends, errors)."""
        for d in deltas:
            if d.error is None and (d.new_token_ids or d.tensors):
                self._output_sent(d.request_id)
        self.sockets.send_api(RequestOutputs(stage_id=self.stage_id, deltas=deltas))

    def _arrive(self, request_id: str) -> None:
        if request_id not in self.arrived:
            self.arrived[request_id] = time.perf_counter()
            while len(self.arrived) > MAX_ROUTES:  # (requests that ended without output)
                self.arrived.popitem(last=False)

    def _output_sent(self, request_id: str) -> None:
        t = self.arrived.pop(request_id, None)
        if t is not None:
            self.first_outputs += 1
            self.first_output_s += time.perf_counter() - t

    def _remember_route(self, request_id: str, replicas: dict[int, int]) -> None:
        if replicas:
            self.routes[request_id] = replicas
            if len(self.routes) > MAX_ROUTES:
                # Forget the oldest routes of requests that ended here, never one still here (a
                # long reply outlives many later requests; without its route its payloads and
                # credits would go to replica 0).
                known = self.known_requests()
                for _ in range(len(self.routes)):
                    if len(self.routes) <= MAX_ROUTES:
                        break
                    rid, route = self.routes.popitem(last=False)
                    if rid in known:
                        self.routes[rid] = route  # (to the newest end)

    def finish_early(self, request_id: str, keep: int = -1) -> None:
        """End this request now as if it had finished (FinishRequest); stages that cannot cut a
        request short ignore it."""

    def known_requests(self) -> set[str]:
        return set(self.waiting)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) for stats."""
        return 0, len(self.waiting)

    def info(self) -> dict[str, str]:
        """Facts the api may need about this stage (e.g. a generator's voices)."""
        return {}

    def close(self) -> None:
        pass

    def admit_prepared(self) -> None:
        """Take in the requests whose preparation off the loop finished (see has_background)."""

    def has_background(self) -> bool:
        """Whether work off the loop (a request's preparation) will need the loop when it is done."""
        return False

    # ---- loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        # (Before ready: a profiling directory that cannot be written fails the start, not a later step.)
        name = f"stage{self.stage_id}-{self.stage.name}-r{self.replica}"
        prof = StepProfiler.from_env(name)
        steplog = StepLog.from_env(name)
        self.sockets.send_api(StageReady(stage_id=self.stage_id, pid=os.getpid(), replica=self.replica,
                                         startup_s=round(self.startup_s, 2), info=self.info(), boot=self.boot))
        idle = 0  # engine steps in a row that advanced no request
        try:
            while self.running:
                busy = self.has_work()
                # Steps that keep advancing nothing wait on something from outside (streamed input, a
                # consumer's credit, a slot while every running request is held): wait for it on the
                # socket, not spin a core (on a CPU host, maybe the one the stage it waits on needs).
                wait_ms = 50 if not busy else IDLE_POLL_MS if idle >= 2 else 0
                if wait_ms and self.has_background():  # (its result is looked for between waits)
                    wait_ms = min(wait_ms, BACKGROUND_POLL_MS)
                t0, n = time.perf_counter(), 0
                for msg in self.sockets.recv_inputs(timeout_ms=wait_ms):
                    self._handle(msg)
                    n += 1
                t1 = time.perf_counter()
                self._start_dirty()
                self.admit_prepared()
                t2 = time.perf_counter()
                if t2 - t0 > self.slow_loop_s:  # (the time a request's input waits for a step)
                    log.warning("stage %d (%s): %.2f s between engine steps: %d messages in %.2f s, inputs "
                                "built in %.2f s", self.stage_id, self.stage.name, t2 - t0, n, t1 - t0, t2 - t1)
                if self.running and self.has_work():
                    if prof is not None:
                        prof.before(self.counts()[0])
                    if steplog is not None:
                        steplog.before(self.counts()[0])
                    t0 = time.perf_counter()
                    served = self.step()
                    took = time.perf_counter() - t0
                    self.step_s += took
                    if steplog is not None:
                        steplog.after(served, took)
                    idle = 0 if served else idle + 1
                    if served:  # (not a step that only told the engine of finished requests)
                        self.steps += 1
                        self.batch_sum += served
                    if prof is not None:
                        prof.after(bool(served))
        finally:
            if prof is not None:
                prof.finish()
            if steplog is not None:
                steplog.finish()
            self.close()

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self._arrive(msg.request_id)
            self._remember_route(msg.request_id, msg.replicas)
            self.add_prompt(msg)
        elif isinstance(msg, ExpectRequest):
            if msg.request_id in self.aborted:
                return
            self._arrive(msg.request_id)
            self._remember_route(msg.request_id, msg.replicas)
            w = self.waiting.setdefault(msg.request_id, _Waiting())
            w.expect = msg
            self._dirty[msg.request_id] = None
        elif isinstance(msg, StagePayload):
            if msg.request_id in self.aborted:  # aborted while its payload was on the way
                return
            if msg.request_id not in self.waiting:
                self._bound_orphans(room=1)
            try:
                self.waiting.setdefault(msg.request_id, _Waiting()).merge(msg)
            except (RuntimeError, ValueError, TypeError) as e:  # a chunk that does not fit the ones before
                log.warning("stage %d: bad payload for %s: %s", self.stage_id, msg.request_id, e)
                self.fail(msg.request_id, f"stage {self.stage.name}: bad input from stage {msg.source_stage}")
                return
            self._dirty[msg.request_id] = None
        elif isinstance(msg, AbortRequest):
            self.abort(msg.request_ids)
        elif isinstance(msg, FinishRequest):
            self.finish_early(msg.request_id, msg.keep)
        elif isinstance(msg, StreamCredit):
            self.credit(msg)
        elif isinstance(msg, StatsQuery):
            self._bound_orphans()
            running, waiting = self.counts()
            self.sockets.send_api(StageStats(
                stage_id=self.stage_id, nonce=msg.nonce, num_running=running, num_waiting=waiting,
                request_ids=sorted(self.known_requests()), steps=self.steps,
                step_s=round(self.step_s, 6), batch_sum=self.batch_sum,
                backpressure_pauses=self.backpressure_pauses, payload_bytes=self.payload_bytes,
                underruns=self.underruns, underrun_s=round(self.underrun_s, 6), cached_tokens=self.cached_tokens,
                first_outputs=self.first_outputs, first_output_s=round(self.first_output_s, 6), pid=os.getpid(),
                startup_s=round(self.startup_s, 2), info=self.info(), replica=self.replica, boot=self.boot))
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            log.warning("stage %d: ignoring unexpected %s", self.stage_id, type(msg).__name__)

    def _bound_orphans(self, room: int = 0) -> None:
        """Drop payloads without a request (see MAX_ORPHAN_PAYLOADS): those older than ORPHAN_TTL_S,
        then the oldest while there are too many (with `room` for new ones) or they hold too many
        bytes. Called before a new one is kept and on every stats query (the api's probe: each second)."""
        now = time.monotonic()
        orphans = [(rid, w) for rid, w in self.waiting.items() if w.expect is None]
        stale = [rid for rid, w in orphans if now - w.since > ORPHAN_TTL_S]
        held = sum(w.nbytes() for _, w in orphans)
        while orphans and (len(orphans) + room > MAX_ORPHAN_PAYLOADS or held > MAX_ORPHAN_BYTES
                           or orphans[0][0] in stale):
            rid, w = orphans.pop(0)
            held -= w.nbytes()
            why = "no request came for it" if rid in stale else "too many pending payloads"
            log.warning("stage %d: dropping the input of %s: %s", self.stage_id, rid, why)
            self.fail(rid, f"stage {self.stage.name}: input dropped ({why})", code=503)

    def _start_dirty(self) -> None:
        """Inputs are processed once per loop, after the drain: a burst of stream chunks for one
        request costs one processor call, not one per chunk. All processors run before any result
        is used, so the stage waits for their device -> host copies after queueing all of them
        (the first wait covers the rest), not between processor calls."""
        dirty, self._dirty = self._dirty, {}
        built = [b for rid in dirty if rid in self.waiting and (b := self._build(rid)) is not None]
        for request_id, stage_input, complete in built:
            stage_input.wait()
            self._hand(request_id, stage_input, complete)

    def _build(self, request_id: str) -> tuple[str, StageInput, bool] | None:
        """The processor's input for the request now: once its input is complete, or, for a
        streamed input, as soon as the processor can build a start from what arrived (and then
        for each new piece); None when there is nothing to hand yet, or it failed."""
        w = self.waiting[request_id]
        streamed = self.stage.input_mode == "stream"
        if w.expect is None or any(src not in w.payloads for src in w.expect.sources):
            return None
        complete = w.complete()
        if not (complete or streamed):
            return None
        since = {}
        if w.started and getattr(self.processor, "incremental", False):
            since["since"] = self.step_rows_given(request_id)
        try:
            stage_input = self.processor(w.payloads, self, dict(w.expect.options), **since)
        except RequestError as e:  # the request's own option is unusable (e.g. an unknown voice)
            log.warning("stage %d: input of %s rejected: %s", self.stage_id, request_id, e)
            self.fail(request_id, f"stage {self.stage.name}: {e}", code=400)
            return None
        except Exception as e:  # a bad payload (the server's fault) fails this request only
            log.exception("stage %d: input processor failed for %s", self.stage_id, request_id)
            self.fail(request_id, server_fault(f"stage {self.stage.name}: input processing failed", e))
            return None
        if stage_input is None:  # a streamed input that cannot start the request yet
            if not w.started:
                # Say so to the sources (once per chunk that did not suffice): a producer `stream_window`
                # ahead of a consumer that never started would otherwise wait for its credit for good.
                self.send_credit(request_id, list(w.expect.sources), 0, waiting=True)
            return None
        return request_id, stage_input, complete

    def _hand(self, request_id: str, stage_input: StageInput, complete: bool) -> None:
        """Start the request with its first input, or extend it with a later one."""
        w = self.waiting[request_id]
        if complete:
            del self.waiting[request_id]
        if not w.started:
            w.started = True
            self.start(w.expect, stage_input, final=complete)
        else:
            self.extend(request_id, stage_input, complete)

    def abort(self, request_ids: list[str]) -> None:
        self.drop(request_ids)
        for rid in request_ids:
            self.waiting.pop(rid, None)
            self.routes.pop(rid, None)
            self.arrived.pop(rid, None)
            self.tombstone(rid)

    def tombstone(self, request_id: str) -> None:
        """Drop what still arrives for this request (payloads in flight); the oldest are forgotten."""
        self.aborted[request_id] = None
        while len(self.aborted) > MAX_TOMBSTONES:
            self.aborted.popitem(last=False)

    def fail(self, request_id: str, error: str, code: int = 500, error_type: str | None = None) -> None:
        self.abort([request_id])
        self.send_outputs([RequestDelta(request_id=request_id, finished=True, finish_reason="error", error=error,
                                        error_code=code, error_type=error_type)])

