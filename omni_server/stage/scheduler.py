"""vLLM schedulers that take the runner's hidden states off each step for the stage loop.

Two classes because vLLM picks AsyncScheduler when async scheduling is on (GPU default) and plain
Scheduler otherwise; subclassing only Scheduler would silently turn async scheduling off (measured
on the H200: the stage loop ran at 0.53-0.71 of vllm.LLM's decode throughput).
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from omni_server.stage.hidden import HiddenCapture


class _TakesHiddenCaptures:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Filled in update_from_output, drained by the stage loop after each engine step.
        self.hidden_captures: list[HiddenCapture] = []

    def update_from_output(self, scheduler_output, model_runner_output):
        capture = getattr(model_runner_output, "omni_hidden", None)
        if capture is not None:
            self.hidden_captures.append(capture)
        return super().update_from_output(scheduler_output, model_runner_output)


class OmniScheduler(_TakesHiddenCaptures, Scheduler):
    pass


class OmniAsyncScheduler(_TakesHiddenCaptures, AsyncScheduler):
    pass


def scheduler_cls_for(async_scheduling: bool) -> str:
    cls = OmniAsyncScheduler if async_scheduling else OmniScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
