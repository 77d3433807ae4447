"""AR stage: vLLM's EngineCore in this process, driven by our loop.

Loop: drain the input socket (add / expect / payload / abort / stats), run one engine step, send
per-request deltas to the api and, when a request with downstream consumers finishes, its tokens
and hidden states straight to those stages.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from omni_server.config.schema import PipelineConfig
from omni_server.stage import processors
from omni_server.stage.hidden import EMIT_HIDDEN
from omni_server.stage.scheduler import scheduler_cls_for
from omni_server.wire.transport import StageSockets
from omni_server.wire.messages import (
    AbortRequest,
    AddRequest,
    ExpectRequest,
    RequestDelta,
    RequestOutputs,
    SamplingSpec,
    Shutdown,
    StagePayload,
    StageReady,
    StageStats,
    StatsQuery,
)

log = logging.getLogger(__name__)

# Payloads that arrived before their ExpectRequest are kept, but not without bound.
MAX_ORPHAN_PAYLOADS = 1024
# Ids of aborted/failed requests remembered, so payloads still in flight for them are dropped.
MAX_TOMBSTONES = 16384


@dataclass
class _Tracked:
    """A request in the engine whose result feeds later stages."""

    prompt_token_ids: list[int]
    forward_to: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    hidden_len: int = 0
    # Captures whose copy may still be in flight, with the index in `hidden` of this request's view
    # and whether the capture's buffer also holds other requests' rows (then the view is cloned once
    # the copy is done, so a long request does not pin every step buffer of its lifetime).
    pending: list[tuple[Any, int, bool]] = field(default_factory=list)

    def settle(self) -> None:
        for capture, index, shared in self.pending:
            capture.wait()
            if shared:
                self.hidden[index] = self.hidden[index].clone()
        self.pending.clear()


@dataclass
class _Waiting:
    """A request announced by the api whose upstream payloads are not all here yet."""

    expect: ExpectRequest | None = None
    payloads: dict[int, StagePayload] = field(default_factory=dict)


def build_engine_args(cfg: PipelineConfig, stage_id: int):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    stage = cfg.stage(stage_id)
    args: dict[str, Any] = dict(stage.engine_args)
    args.setdefault("model", stage.model)
    if stage.tokenizer:
        args.setdefault("tokenizer", stage.tokenizer)
    on_cpu = current_platform.device_type == "cpu"
    args["worker_cls"] = (
        "omni_server.stage.cpu_worker.CPUOmniWorker" if on_cpu else "omni_server.stage.gpu_worker.GPUOmniWorker"
    )
    if stage.inputs:
        args.setdefault("enable_prompt_embeds", True)
    if cfg.consumers(stage_id):
        # Consumers need hidden states for every prompt position; cached prefixes would skip them.
        args["enable_prefix_caching"] = False
    return EngineArgs(**args)


class ARStage:
    def __init__(self, cfg: PipelineConfig, stage_id: int, sockets: StageSockets):
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.executor import Executor

        t0 = time.monotonic()
        self.cfg = cfg
        self.stage_id = stage_id
        self.stage = cfg.stage(stage_id)
        self.sockets = sockets
        self.vllm_config = build_engine_args(cfg, stage_id).create_engine_config()
        sched = self.vllm_config.scheduler_config
        # Chosen after the platform settled async scheduling (on for GPUs, off on CPU).
        sched.scheduler_cls = scheduler_cls_for(sched.async_scheduling)
        self.dtype = self.vllm_config.model_config.dtype
        self.core = EngineCore(self.vllm_config, Executor.get_class(self.vllm_config), log_stats=False)
        self.inputs = InputProcessor(self.vllm_config)
        self.tasks = self.core.get_supported_tasks()
        self.processor = processors.get(self.stage.input_processor) if self.stage.input_processor else None
        self.send_tokens = self.stage.output is not None
        self.tracked: dict[str, _Tracked] = {}
        self.waiting: dict[str, _Waiting] = {}
        self.in_engine: set[str] = set()
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self._unsettled: list[_Tracked] = []
        self.steps = 0
        self.running = True
        self.startup_s = time.monotonic() - t0

    # ---- lifecycle --------------------------------------------------------------------------

    def run(self) -> None:
        self.sockets.send_api(
            StageReady(stage_id=self.stage_id, pid=os.getpid(), startup_s=round(self.startup_s, 2))
        )
        try:
            while self.running:
                busy = self.core.scheduler.has_requests()
                for msg in self.sockets.recv_inputs(timeout_ms=0 if busy else 50):
                    self._handle(msg)
                if self.running and self.core.scheduler.has_requests():
                    self._step()
        finally:
            self.core.shutdown()

    # ---- inputs -------------------------------------------------------------------------------

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg.request_id, {"type": "token", "prompt_token_ids": msg.prompt_token_ids},
                      msg.sampling, msg.forward_to, msg.prompt_token_ids)
        elif isinstance(msg, ExpectRequest):
            if msg.request_id in self.aborted:
                return
            w = self.waiting.setdefault(msg.request_id, _Waiting())
            w.expect = msg
            self._maybe_start(msg.request_id)
        elif isinstance(msg, StagePayload):
            if msg.request_id in self.aborted:  # aborted while its payload was on the way
                return
            if msg.request_id not in self.waiting:
                self._bound_orphans()
            self.waiting.setdefault(msg.request_id, _Waiting()).payloads[msg.source_stage] = msg
            self._maybe_start(msg.request_id)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_ids)
        elif isinstance(msg, StatsQuery):
            sched = self.core.scheduler
            known = sorted(self.in_engine | set(self.waiting) | set(self.tracked))
            self.sockets.send_api(StageStats(
                stage_id=self.stage_id, nonce=msg.nonce, num_running=len(sched.running),
                num_waiting=len(sched.waiting), request_ids=known, steps=self.steps, pid=os.getpid(),
                startup_s=round(self.startup_s, 2)))
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            log.warning("stage %d: ignoring unexpected %s", self.stage_id, type(msg).__name__)

    def _bound_orphans(self) -> None:
        orphans = [rid for rid, w in self.waiting.items() if w.expect is None]
        if len(orphans) >= MAX_ORPHAN_PAYLOADS:
            oldest = orphans[0]
            log.warning("stage %d: too many payloads without a request; failing %s", self.stage_id, oldest)
            self._fail(oldest, f"stage {self.stage.name}: input dropped (too many pending payloads)", code=503)

    def _maybe_start(self, request_id: str) -> None:
        w = self.waiting[request_id]
        if w.expect is None or any(src not in w.payloads for src in w.expect.sources):
            return
        del self.waiting[request_id]
        try:
            stage_input = self.processor(w.payloads, self)
        except Exception as e:  # a bad payload fails this request only
            log.exception("stage %d: input processor failed for %s", self.stage_id, request_id)
            self._fail(request_id, f"stage {self.stage.name}: input processing failed: {e}")
            return
        prompt_ids = stage_input.prompt.get("prompt_token_ids") or []
        self._add(request_id, stage_input.prompt, w.expect.sampling, w.expect.forward_to, prompt_ids)

    def _add(self, request_id: str, prompt: dict, spec: SamplingSpec, forward_to: list[int],
             prompt_token_ids: list[int]) -> None:
        try:
            params = self._sampling_params(spec, emit_hidden=bool(forward_to))
            request = self.inputs.process_inputs(request_id, prompt, params, supported_tasks=self.tasks)
            req, wave = self.core.preprocess_add_request(request)
            self.core.add_request(req, wave)
        except Exception as e:  # invalid request (too long, bad params): fail it, keep serving
            log.warning("stage %d: rejected %s: %s", self.stage_id, request_id, e)
            self._fail(request_id, f"stage {self.stage.name}: {e}", code=400)
            return
        self.in_engine.add(request_id)
        if forward_to:
            self.tracked[request_id] = _Tracked(list(prompt_token_ids), list(forward_to))

    def _sampling_params(self, spec: SamplingSpec, emit_hidden: bool):
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
            top_k=spec.top_k, min_tokens=spec.min_tokens, seed=spec.seed,
            repetition_penalty=spec.repetition_penalty, stop_token_ids=list(spec.stop_token_ids),
            ignore_eos=spec.ignore_eos, detokenize=False,
            extra_args={EMIT_HIDDEN: True} if emit_hidden else None,
        )

    def _abort(self, request_ids: list[str]) -> None:
        in_engine = [r for r in request_ids if r in self.in_engine]
        if in_engine:
            self.core.abort_requests(in_engine)
        for rid in request_ids:
            self.in_engine.discard(rid)
            self.tracked.pop(rid, None)
            self.waiting.pop(rid, None)
            self.aborted[rid] = None
        while len(self.aborted) > MAX_TOMBSTONES:
            self.aborted.popitem(last=False)

    def _fail(self, request_id: str, error: str, code: int = 500) -> None:
        self._abort([request_id])
        self.sockets.send_api(RequestOutputs(stage_id=self.stage_id, deltas=[
            RequestDelta(request_id=request_id, finished=True, finish_reason="error", error=error,
                         error_code=code)]))

    # ---- engine step ------------------------------------------------------------------------

    def _step(self) -> None:
        outputs, executed = self.core.step_fn()
        self.core.post_step(executed)
        self.steps += 1
        # Last step's copies are done by now (the engine waited for that step's tokens): settle them.
        for tracked in self._unsettled:
            tracked.settle()
        self._unsettled = [t for c in self.core.scheduler.hidden_captures for t in self._collect_hidden(c)]
        self.core.scheduler.hidden_captures.clear()
        if not outputs:
            return
        deltas: list[RequestDelta] = []
        for eco in outputs.values():
            for out in eco.outputs:
                rid = out.request_id
                finished = out.finish_reason is not None
                tracked = self.tracked.get(rid)
                if tracked is not None:
                    tracked.output_token_ids.extend(out.new_token_ids)
                if self.send_tokens or finished:
                    reason = str(out.finish_reason) if finished else None
                    deltas.append(RequestDelta(
                        request_id=rid,
                        new_token_ids=list(out.new_token_ids) if self.send_tokens else [],
                        finished=finished,
                        finish_reason=reason,
                        error=f"stage {self.stage.name}: engine error" if reason == "error" else None,
                    ))
                if finished:
                    self.in_engine.discard(rid)
                    if tracked is not None:
                        del self.tracked[rid]
                        self._forward(rid, tracked)
        if deltas:
            self.sockets.send_api(RequestOutputs(stage_id=self.stage_id, deltas=deltas))

    def _collect_hidden(self, capture) -> list[_Tracked]:
        """Append each tracked request's rows (views: the copy may still be in flight)."""
        shared = len(capture.req_ids) > 1
        touched, offset = [], 0
        for rid, n, start in zip(capture.req_ids, capture.counts, capture.starts):
            tracked = self.tracked.get(rid)
            if tracked is not None:
                if start < tracked.hidden_len:  # recomputed after preemption: drop the stale tail
                    tracked.settle()
                    _truncate(tracked, start)
                tracked.hidden.append(capture.hidden[offset : offset + n])
                tracked.pending.append((capture, len(tracked.hidden) - 1, shared))
                tracked.hidden_len += n
                touched.append(tracked)
            offset += n
        return touched

    def _forward(self, request_id: str, tracked: _Tracked) -> None:
        for capture, _, _ in tracked.pending:
            capture.wait()  # no clone needed: torch.cat below copies
        tracked.pending.clear()
        hidden = torch.cat(tracked.hidden) if tracked.hidden else torch.empty(0)
        payload = StagePayload(
            request_id=request_id, source_stage=self.stage_id,
            prompt_token_ids=tracked.prompt_token_ids, output_token_ids=tracked.output_token_ids,
            tensors={"hidden": hidden},
        )
        for dst in tracked.forward_to:
            self.sockets.send_stage(dst, payload)


def _truncate(tracked: _Tracked, length: int) -> None:
    kept, total = [], 0
    for chunk in tracked.hidden:
        if total >= length:
            break
        kept.append(chunk[: length - total])
        total += kept[-1].shape[0]
    tracked.hidden, tracked.hidden_len = kept, total
