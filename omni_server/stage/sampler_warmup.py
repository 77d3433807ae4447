"""Compile vLLM's top-k / top-p sampling kernel variants when a stage starts, not on a live batch.

On CUDA, vLLM filters top-k / top-p with a Triton kernel once a batch has 8 or more rows. Triton
compiles one variant per (row count a multiple of 16 or not) x (which of the two filters is on);
vLLM's own warm-up samples max_num_seqs rows with both on, so any other variant compiles the first
time a batch needs it, and the whole stage waits for that compile. Measured on the H200
(2026-11-30): every 7B server's first c=16 burst hit it in the talker, and time to first audio
went from ~2 s to 9.8 s and 13.1 s on the servers where it compiled longest.
"""

from __future__ import annotations

import os

import torch

# vLLM's dispatch (vllm/v1/sample/ops/topk_topp_sampler.py: apply_top_k_top_p): Triton from here up.
TRITON_MIN_ROWS = 8


def warm_rows(max_rows: int) -> list[int]:
    """Row counts that reach every row-count variant of a batch of up to `max_rows` rows."""
    rows = set()
    if max_rows >= TRITON_MIN_ROWS:
        rows.add(9 if max_rows >= 9 else TRITON_MIN_ROWS)  # not a multiple of 16
    if max_rows >= 16:
        rows.add(16)
    return sorted(rows)


def warm_top_k_top_p(vocab_size: int, max_rows: int, device: torch.device) -> int:
    """Run vLLM's top-k / top-p filter on every variant a batch of up to `max_rows` rows can
    need; returns how many calls were made (0 where vLLM would not use Triton)."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    if not HAS_TRITON or torch.device(device).type != "cuda":
        return 0
    calls = 0
    for rows in warm_rows(max_rows):
        k = torch.full((rows,), min(20, vocab_size), dtype=torch.int64, device=device)
        p = torch.full((rows,), 0.9, dtype=torch.float32, device=device)
        for top_k, top_p in ((k, p), (k, None), (None, p)):
            # The sampler hands float32 logits, contiguous, one row per request.
            logits = torch.randn(rows, vocab_size, dtype=torch.float32, device=device)
            apply_top_k_top_p(logits, top_k, top_p)
            calls += 1
    torch.cuda.synchronize(device)
    return calls


def pin_triton_cache(device_index: int) -> str:
    """Fix the process's Triton cache directory before any kernel compiles, to the one Inductor
    picks (`$TORCHINDUCTOR_CACHE_DIR/triton/<device>`, unless TRITON_CACHE_DIR is set).

    Inductor sets TRITON_CACHE_DIR for the whole process only once it compiles or loads a kernel
    itself; until then Triton uses ~/.triton/cache. On a cold vLLM compile that happened before our
    warm-ups, on a warm one not, so each start wrote these kernels where the next did not look: on
    the H200 (2026-11-30f) the first two starts both spent ~20 s on them, the third none. Pinned,
    every start reads where the last wrote (docker: the `~/.cache` volume, see its Dockerfile)."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device_index)  # (the variable itself when set)
    return os.environ["TRITON_CACHE_DIR"]
