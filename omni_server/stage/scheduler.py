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
        held = [r for r in self.running if self.held(r)] if self.held is not None else []
        if not held:
            return super().schedule(*args, **kwargs)
        # Out of `running` for this one schedule() call: they keep their KV cache and their slot (the
        # count vLLM keeps for paused streaming sessions makes admission leave room for them).
        self.running = [r for r in self.running if r not in held]
        self.num_waiting_for_streaming_input += len(held)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.num_waiting_for_streaming_input -= len(held)
            self.running.extend(r for r in held if r not in self.running)

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
