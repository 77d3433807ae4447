"""vLLM scheduler (EngineArgs.scheduler_cls) that takes the runner's hidden states off each step."""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from omni_server.stage.hidden import HiddenCapture


class OmniScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Filled in update_from_output, drained by the stage loop after each engine step.
        self.hidden_captures: list[HiddenCapture] = []

    def update_from_output(self, scheduler_output, model_runner_output):
        capture = getattr(model_runner_output, "omni_hidden", None)
        if capture is not None:
            self.hidden_captures.append(capture)
        return super().update_from_output(scheduler_output, model_runner_output)
