"""Compile vLLM's fused-MoE Triton kernels for the token counts a stage will run, when it starts.

vLLM picks the fused-MoE kernel's block sizes by the batch's token count, and Triton compiles one
variant per block-size config and per specialisation of its integer arguments (1, a multiple of 16
or not). vLLM's own warm-up runs the CUDA-graph sizes (decode batches) only, so prefills of other
sizes compile in a live step, and the whole stage waits: on the H200 (2026-11-30) vLLM's JIT
monitor flagged `fused_moe_kernel` in the first Qwen3-Omni request of both MoE stages, and at c=16
the talker's first chunk left 2.85 s after its requests started (0.18 s at c=1).
"""

from __future__ import annotations

import torch


def warm_sizes(max_tokens: int) -> list[int]:
    """Token counts up to `max_tokens`: each of vLLM's token-count buckets in both forms. Its tuned
    configs are keyed by powers of two and by 1.5 times them (24, 48, 96, 1536, 3072: E=128 H200
    files), a batch of M tokens taking the nearest key; the kernel's integer arguments are M times
    top-k and that plus padding, so a multiple of 16 and an odd count in a bucket give both of
    Triton's specialisations whatever top-k is. Warming powers of two only left the 1536 bucket to a live
    step (a c=16 Qwen3 talker prefill, H200 2026-11-30g); warming the top bucket at `max_tokens`
    only (a multiple of 16) left its odd counts to one (2026-12-01, the talker's 2048 bucket)."""
    sizes, p = set(), 1
    while p <= max_tokens:
        sizes.update(n for q in (p, p * 3 // 2) for n in (q, q + 1) if n <= max_tokens)
        p *= 2
    # The top bucket may hold no key + 1, or no multiple of 16 (its keys' midpoint can fall a few
    # counts below `max_tokens`): 16 consecutive counts there give every M * top-k residue.
    sizes.update(range(max(max_tokens - 15, 1), max_tokens + 1))
    return sorted(sizes)


def uses_fused_moe(model: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return any(isinstance(m, MoERunner) for m in model.modules())


def warm_fused_moe(runner, max_tokens: int) -> int:
    """A dummy forward (vLLM's own warm-up call) at each of `warm_sizes` for a model with fused-MoE
    layers; returns how many ran (0 for other models)."""
    if not uses_fused_moe(runner.get_model()):
        return 0
    from vllm.config import CUDAGraphMode

    sizes = warm_sizes(max_tokens)
    for n in sorted(sizes, reverse=True):  # (the largest first, as vLLM's warm-up)
        # Without CUDA graphs: left to vLLM's dispatcher, a CUDA-graph size would be captured here,
        # outside vLLM's capture phase (it refuses: "CUDA graph capturing detected at an
        # inappropriate time", H200 2026-11-30f).
        runner._dummy_run(n, cudagraph_runtime_mode=CUDAGraphMode.NONE, skip_eplb=True, remove_lora=False)
    return len(sizes)
