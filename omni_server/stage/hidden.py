"""Per-step hidden-state capture handed from the model runner to the stage loop.

On CUDA the rows are gathered on the compute stream (a private copy, so the next forward may reuse
vLLM's buffers) and copied to pinned host memory on a side stream; nothing waits for that copy in
the decode loop. The stage loop calls `wait()` a step later (the copy is done by then) or when a
request finishes in this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# SamplingParams.extra_args key the stage loop sets on requests whose output feeds a later stage.
EMIT_HIDDEN = "omni_emit_hidden"
# SamplingParams.extra_args key carrying a request's per-step input embeddings (StageInput.step_embeds).
STEP_EMBEDS = "omni_step_embeds"
# SamplingParams.extra_args key carrying a request's prompt M-RoPE positions ([3, prompt_len] int64,
# StageInput.positions) computed upstream, for a model that cannot derive them from its own prompt.
MROPE_POSITIONS = "omni_mrope_positions"


@dataclass
class HiddenCapture:
    req_ids: list[str]
    # Rows per request, in the order of req_ids; rows of request i start at sum(counts[:i]).
    counts: list[int]
    # Position (in prompt + output tokens) of each request's first row in this step.
    starts: list[int]
    hidden: torch.Tensor  # [sum(counts), hidden_size], on the host (pinned on CUDA hosts)
    event: Any = field(default=None, repr=False)  # torch.cuda.Event marking the copy done
    # M-RoPE models: the whole prompt's positions ([3, prompt_len], host) of each request whose
    # prompt starts in this step; downstream stages reading these rows may need them.
    positions: dict[str, torch.Tensor] = field(default_factory=dict)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def __getstate__(self) -> dict:
        # Crossing a process boundary (vLLM multiproc executor): the bytes must be final.
        self.wait()
        return {**self.__dict__, "event": None}
