"""Fused-MoE kernel variants compiled at stage start (omni_server/stage/moe_warmup.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from omni_server.stage.moe_warmup import uses_fused_moe, warm_fused_moe, warm_sizes


def test_sizes_reach_every_bucket_in_both_forms():
    assert warm_sizes(1) == [1]
    assert warm_sizes(20) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    sizes = warm_sizes(2048)
    assert sizes[-1] == 2048 and all(n <= 2048 for n in sizes) and len(sizes) < 60
    # vLLM's tuned configs for the Qwen3-30B-A3B experts (thinker N=768, top-k 8) and the Qwen3-Omni
    # talker's (N=384, top-k 6) on an H200: every batch size a stage may run picks a config (the
    # nearest key, the smaller on a tie) and a Triton specialisation of M * top-k (a multiple of 16
    # or not); for every token budget up to 8192 a warmed size must have compiled each such pair.
    import json
    from pathlib import Path

    import vllm.model_executor.layers.fused_moe as fused_moe

    for n, top_k in ((768, 8), (384, 6)):
        table = Path(fused_moe.__file__).parent / "configs" / f"E=128,N={n},device_name=NVIDIA_H200.json"
        keys = sorted(int(k) for k in json.loads(table.read_text()))

        def variant(m):
            return min(keys, key=lambda k: abs(k - m)), m * top_k % 16 == 0

        runnable = set()  # the pairs of every count up to the budget
        for max_tokens in range(1, 8193):
            runnable.add(variant(max_tokens))
            missing = runnable - {variant(m) for m in warm_sizes(max_tokens)}
            assert not missing, (n, max_tokens, sorted(missing))
    assert {1536, 1537, 3072, 3073} <= set(warm_sizes(4096))


def _runner(model):
    ran = []
    return SimpleNamespace(get_model=lambda: model, _dummy_run=lambda n, **kw: ran.append((n, kw))), ran


def test_only_models_with_fused_moe_layers_are_warmed():
    runner, ran = _runner(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert not uses_fused_moe(runner.get_model())
    assert warm_fused_moe(runner, 64) == 0 and ran == []


def test_a_moe_model_runs_every_size_once():
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    class FakeMoE(moe_runner.MoERunner):  # (stands in for a real layer: only its type is read)
        def __init__(self):
            torch.nn.Module.__init__(self)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), FakeMoE())
    runner, ran = _runner(model)
    assert uses_fused_moe(model)
    assert warm_fused_moe(runner, 40) == len(warm_sizes(40))
    assert sorted(n for n, _ in ran) == warm_sizes(40) and ran[0][0] == 40  # largest first
    from vllm.config import CUDAGraphMode

    # Never a CUDA-graph capture: that is vLLM's to do, in its capture phase (CUDA test: the Qwen3
    # e2e tests under torch.compile, whose MoE stages capture graphs).
    assert all(kw == {"cudagraph_runtime_mode": CUDAGraphMode.NONE, "skip_eplb": True, "remove_lora": False}
               for _, kw in ran)
