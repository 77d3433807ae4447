"""How much of one audio clip a stage's multimodal processor reads."""

from __future__ import annotations

import inspect
from typing import Any


def audio_clip_seconds(model_config: Any) -> float | None:
    """Seconds of a clip the model hears, where its processor cuts longer clips: a Whisper-style
    feature extractor (`n_samples` at `sampling_rate`) called with truncation, its default, keeps the
    first `n_samples` (Qwen2.5-Omni's: 30 s). None: the whole clip is read, or the stage takes no audio."""
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None or mm.get_limit_per_prompt("audio") == 0:
        return None
    from vllm.transformers_utils.processor import cached_processor_from_config

    try:
        processor = cached_processor_from_config(model_config)
    except Exception:  # (no processor of its own: nothing cuts a clip here)
        return None
    extractor = getattr(processor, "feature_extractor", None)
    samples, rate = getattr(extractor, "n_samples", None), getattr(extractor, "sampling_rate", None)
    if not samples or not rate:
        return None
    # Whose word counts, last wins: the extractor's default, the processor's own call defaults, the
    # deployment's mm_processor_kwargs.
    param = inspect.signature(extractor.__call__).parameters.get("truncation")
    truncation = param is not None and param.default is True
    kwargs = getattr(type(processor), "valid_processor_kwargs", None)
    truncation = getattr(kwargs, "_defaults", {}).get("audio_kwargs", {}).get("truncation", truncation)
    truncation = (mm.mm_processor_kwargs or {}).get("truncation", truncation)
    return samples / rate if truncation else None
