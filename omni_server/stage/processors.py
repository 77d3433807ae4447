"""Stage input processors: upstream StagePayloads -> this stage's engine input.

A processor is registered by name and named in the YAML (`input_processor`). Generic ones live
here; model-specific ones live in `omni_server/models/<family>/` and register on import. A name
`family.proc` imports `omni_server.models.family` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from omni_server.config.schema import PipelineConfig
from omni_server.wire.messages import StagePayload


@dataclass
class StageInput:
    """What a processor returns: an engine input plus optional per-request side data."""

    # AR stages: a vllm TokensInput / EmbedsInput dict (`type` key set).
    prompt: dict[str, Any] | None = None
    # AR stages: [rows, hidden] added to the input embedding of output token k (row min(k, rows-1)),
    # for models fed a per-step signal from upstream (e.g. a talker reading the thinker's reply).
    # On the host, or (rows after the first, `since` calls) on the stage's device with `step_ready`.
    step_embeds: torch.Tensor | None = None
    # Device step_embeds: the event their reader's stream waits for (transfer.handoff / receive).
    step_ready: Any = None
    # Host tensors above still being copied from the device (transfer.to_host): the event the
    # stage waits for (`wait`) after building all of a loop's inputs.
    host_ready: Any = None
    # AR stages of M-RoPE models: the prompt's positions, [3, prompt_len] int64, where the model
    # cannot derive them from its own prompt (e.g. a talker whose prompt mirrors an image prompt).
    positions: torch.Tensor | None = None
    # Generation stages: the generator's keyword inputs.
    data: dict[str, Any] | None = None
    # Index of step_embeds' first row in the request's rows: an incremental processor called with
    # `since` (see below) returns only the rows from there on.
    step_offset: int = 0

    def wait(self) -> None:
        """Until the host tensors are filled (a no-op unless `host_ready`)."""
        if self.host_ready is not None:
            self.host_ready.synchronize()
            self.host_ready = None


# (payloads by source stage, the stage object, the request's options such as {"voice": ...}).
# A processor may return None for a streamed input that cannot start the request yet, may have
# a `prepare(stage)` attribute that loads its tables when the stage starts, and `reads_hidden =
# False` when it uses only its sources' tokens (they then skip capturing and sending hidden states).
# With `incremental = True` it is called for a started streamed request with `since=N` (the step
# rows the stage holds already) and builds only step rows N.. (no prompt): each chunk then costs
# its own rows, not the whole input so far. `prompt_rows_added = N`: the prompt it builds holds at
# most its source's prompt plus N rows (what `context_notes` checks the stage's context against).
Processor = Callable[[dict[int, StagePayload], Any, dict[str, str]], StageInput | None]
_REGISTRY: dict[str, Processor] = {}


def register(name: str) -> Callable[[Processor], Processor]:
    def deco(fn: Processor) -> Processor:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"input processor {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def get(name: str) -> Processor:
    if name not in _REGISTRY:
        from omni_server.models import import_family

        import_family(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        from omni_server.models import all_names

        raise KeyError(f"unknown input processor {name!r}; known: {all_names(_REGISTRY)}") from None


def reads_hidden(name: str | None) -> bool:
    """Whether the named processor reads its sources' hidden states."""
    return name is None or getattr(get(name), "reads_hidden", True)


@register("hidden_to_embeds")
def hidden_to_embeds(payloads: dict[int, StagePayload], ctx: Any, options: dict[str, str]) -> StageInput:
    """The upstream stage's final hidden states (prompt + generated positions) as prompt embeddings."""
    (payload,) = payloads.values()
    hidden = payload.tensors.get("hidden")
    if hidden is None:
        raise ValueError(f"stage {payload.source_stage} sent no hidden states")
    # Frames are read-only and owned by zmq; vLLM keeps the tensor, so give it its own memory.
    return StageInput(prompt={"type": "embeds", "prompt_embeds": hidden.to(ctx.dtype, copy=True)})


def context_notes(cfg: PipelineConfig) -> list[str]:
    """AR stages whose context cannot hold the longest prompt their source takes (its context less
    one reply token) plus the rows their processor adds and their default max_tokens: a prompt that
    long would cut their output (the speech) short, or fail it once the reply has begun."""
    out = []
    for stage in cfg.stages:
        if stage.kind != "ar" or len(stage.inputs) != 1 or not stage.input_processor:
            continue
        source = cfg.stage(stage.inputs[0])
        added = getattr(get(stage.input_processor), "prompt_rows_added", None)
        context, source_context = stage.engine_args.get("max_model_len"), source.engine_args.get("max_model_len")
        if added is None or not isinstance(context, int) or not isinstance(source_context, int) or source_context < 2:
            continue
        need = source_context - 1 + added + (stage.default_sampling.max_tokens or 1)
        if context < need:
            out.append(f"stage {stage.id} ({stage.name}): max_model_len {context} cannot hold the longest prompt "
                       f"stage {source.id} ({source.name}) takes ({source_context - 1} tokens) plus the {added} rows "
                       f"{stage.input_processor} adds and max_tokens {stage.default_sampling.max_tokens or 1}: "
                       f"{need} would; with a prompt that long its output is cut short or fails")
    return out
