"""Top-k / top-p kernel variants compiled at stage start (omni_server/stage/sampler_warmup.py)."""

from __future__ import annotations

import pytest
import torch

from omni_server.stage.sampler_warmup import pin_triton_cache, warm_rows, warm_top_k_top_p


def test_rows_reach_both_row_count_variants_vllm_sends_to_triton():
    assert warm_rows(4) == []  # vLLM filters fewer than 8 rows in PyTorch
    assert warm_rows(8) == [8]
    assert warm_rows(12) == [9]
    assert warm_rows(32) == [9, 16]


def test_triton_cache_is_pinned_where_inductor_would_put_it(tmp_path, monkeypatch):
    # Every start of a stage reads and writes the same Triton cache, whether or not Inductor has
    # compiled or loaded a kernel first (then Triton's own default, ~/.triton/cache, was used).
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert pin_triton_cache(1) == str(tmp_path / "inductor" / "triton" / "1")
    assert triton_cache_dir(1) == str(tmp_path / "inductor" / "triton" / "1")  # what Inductor then uses
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert pin_triton_cache(0) == str(tmp_path / "mine")  # a user's setting stands


def test_nothing_to_warm_on_cpu():
    assert warm_top_k_top_p(1000, 32, torch.device("cpu")) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_no_batch_compiles_after_the_warm_up():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.ops.topk_topp_triton import _topk_topp_kernel

    vocab, device = 1000, torch.device("cuda")
    assert warm_top_k_top_p(vocab, 32, device) == 6
    compiled = _topk_topp_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(compiled)
    assert before >= 6
    for rows in (8, 11, 15, 16, 23, 32):
        k = torch.full((rows,), 5, dtype=torch.int64, device=device)
        p = torch.full((rows,), 0.5, device=device)
        for top_k, top_p in ((k, p), (k, None), (None, p)):
            logits = torch.randn(rows, vocab, device=device)
            out = apply_top_k_top_p(logits, top_k, top_p)
            if top_k is not None:  # (the filter ran: at most k logits per row survive)
                assert (torch.isfinite(out).sum(dim=1) <= 5).all()
    assert len(compiled) == before
