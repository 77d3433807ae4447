"""Shared by talker models: ids a model must never sample, masked in its own logits (cheaper than a
per-request logit bias over hundreds of ids, and it holds for every request)."""

from __future__ import annotations

import torch


def suppress(logits: torch.Tensor | None, banned: torch.Tensor) -> torch.Tensor | None:
    """-inf at the `banned` ([vocab] bool) ids of `logits` ([rows, >= vocab]), in place."""
    if logits is not None:
        logits[:, : banned.numel()].masked_fill_(banned, float("-inf"))
    return logits
