"""vLLM schedulers that take the runner's hidden states off each step for the stage loop, and hold
back requests whose next input has not arrived yet (streamed stage inputs).

Two classes because vLLM picks AsyncScheduler when async scheduling is on (GPU default) and plain
Scheduler otherwise; subclassing only Scheduler would silently turn async scheduling off (measured
on the H200: the stage loop ran at 0.53-0.71 of vllm.LLM's decode throughput).
"""

from __future__ import annotations

from typing import Callable

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from omni_server.stage.hidden import HiddenCapture


class _TakesHiddenCaptures:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Filled in update_from_output, drained by the stage loop after each engine step.
        self.hidden_captures: list[HiddenCapture] = []
        self.frames: list[dict] = []  # per step: {request id: (output token index, frame)}
        # Set by the stage loop: True for a running request that must sit this step out (its next
        # step's input embedding is still on its way from the upstream stage).
        self.held: Callable[[Request], bool] | None = None
        # Per-step input rows that arrived for running requests, delivered to the runner with the
        # next scheduler output (no extra round trip to the workers; in order with the steps).
        self.step_embeds_out: dict[str, list] = {}
        self.scheduled = 0  # requests in the batches scheduled so far (the stage's batch statistic)
        # Set by the stage loop for a stage that streams to or from another: admit a request only
        # while the KV cache can hold every running one to its end, so none is ever preempted (see
        # _admissible).
        self.reserve_kv = False

    def queue_step_embeds(self, request_id: str, rows, ready=None) -> None:
        """Rows for the runner with the next step; `ready`: the event device rows wait for."""
        self.step_embeds_out.setdefault(request_id, []).append((rows, ready))

    def schedule(self, *args, **kwargs):
        out = self._schedule(*args, **kwargs)
        self.scheduled += len(out.num_scheduled_tokens)
        if self.step_embeds_out:
            out.omni_step_embeds, self.step_embeds_out = self.step_embeds_out, {}
        return out

    def _schedule(self, *args, **kwargs):
        if not self.reserve_kv or not (self.waiting or self.skipped_waiting):
            return self._schedule_unheld(*args, **kwargs)
        cap = self.max_num_running_reqs
        self.max_num_running_reqs = min(cap, self._admissible())
        try:
            return self._schedule_unheld(*args, **kwargs)
        finally:
            self.max_num_running_reqs = cap

    def _admissible(self) -> int:
        """Running requests (held ones too) plus the waiting ones the KV cache can take, counting
        each request's blocks up to its end (prompt + max_tokens, at most max_model_len): then no
        running request ever lacks a block, and none is preempted. A stage in a stream must not be:
        a held request keeps its blocks (it cannot be preempted), so with preemption a producer's
        held requests could wait on a consumer whose own requests wait on the producer's preempted
        ones. Waiting requests count largest first, whichever of them vLLM admits."""
        # Each group's own block size (with several, self.block_size is their least common multiple);
        # every group draws on the one pool. (A group that needs fewer, e.g. a sliding window's, is
        # over-counted: safe.)
        sizes = [g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups] or [self.block_size]
        length = self.max_model_len

        def blocks(r: Request) -> int:
            end = min(length, r.num_prompt_tokens + (r.max_tokens or 0)) + 1  # (+1: a step's placeholder)
            return sum(-(-end // size) for size in sizes)

        free = self.kv_cache_manager.block_pool.num_gpu_blocks - 1 - sum(blocks(r) for r in self.running)
        running = len(self.running) + self.num_waiting_for_streaming_input
        admit = 0
        for need in sorted((blocks(r) for q in (self.waiting, self.skipped_waiting) for r in q), reverse=True):
            if need > free:
                break
            free, admit = free - need, admit + 1
        return running + admit if running or admit else 1

    def _schedule_unheld(self, *args, **kwargs):
        held = [r for r in self.running if self.held(r)] if self.held is not None else []
        if not held:
            return super().schedule(*args, **kwargs)
        # Out of `running` for this one schedule() call: they keep their KV cache and their slot (the
        # count vLLM keeps for paused streaming sessions makes admission leave room for them).
        # Put back where they were: vLLM hands out the token budget in `running` order, and a
        # held decode at the end would wait behind a newer request's chunked prefill.
        order = {id(r): i for i, r in enumerate(self.running)}
        self.running = [r for r in self.running if r not in held]
        self.num_waiting_for_streaming_input += len(held)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.num_waiting_for_streaming_input -= len(held)
            present = {id(r) for r in self.running}
            merged = self.running + [r for r in held if id(r) not in present]
            self.running = sorted(merged, key=lambda r: order.get(id(r), len(order)))  # (admitted ones last)

    def update_from_output(self, scheduler_output, model_runner_output):
        capture = getattr(model_runner_output, "omni_hidden", None)
        if capture is not None:
            self.hidden_captures.append(capture)
        frames = getattr(model_runner_output, "omni_frames", None)
        if frames:
            self.frames.append(frames)
        return super().update_from_output(scheduler_output, model_runner_output)


class OmniScheduler(_TakesHiddenCaptures, Scheduler):
    pass


class OmniAsyncScheduler(_TakesHiddenCaptures, AsyncScheduler):
    pass


def scheduler_cls_for(async_scheduling: bool) -> str:
    cls = OmniAsyncScheduler if async_scheduling else OmniScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
