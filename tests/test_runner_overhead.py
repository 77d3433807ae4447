"""benchmarks/runner_overhead.py's stage mode runs (on the tiny LM here; the H200 runs it on 7B shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


# A plain LM with the talker's sampling drawn by our sampler (as served); an omni thinker with vLLM's.
# The thinker as served: prefix caching on, its rows kept beside the KV cache.
@pytest.mark.parametrize("model,sampling,caching", [("tiny-embeds-lm", "talker-omni", []),
                                                    ("tiny-qwen2_5-omni", "talker", ["--prefix-caching"])])
def test_stage_mode_reports_a_rate_per_batch(tiny_models, model, sampling, caching, tmp_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
           "OMNI_PROFILE": f"dir={tmp_path},batch=2,skip=1,steps=3"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/runner_overhead.py", "--model", str(tiny_models[model]),
         "--mode", "omni", "--batch", "1", "2", "--input-len", "16", "--output-len", "8", "--dtype", "float32",
         "--enforce-eager", "--sampling", sampling, *caching,  # (the talker's sampling: temperature, top-k/p, penalty)
         # On CPU this is the share of host memory vLLM reserves: other test servers hold the rest.
         "--gpu-memory-utilization", "0.05"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [(r["mode"], r["sampling"], r["batch"]) for r in rows] == [("omni-emit", sampling, 1), ("omni-emit", sampling, 2)]
    assert all(r["tok_s"] > 0 and r["hbm_tb_s"] >= 0 and r["prefix_caching"] == bool(caching) for r in rows)
    assert all(r["runs"] == 3 and r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"] for r in rows)  # median of 3
    # OMNI_PROFILE profiles steps of the loop as in a stage: 3 of those with 2 requests running.
    assert (tmp_path / "runner.txt").read_text().startswith("3 steps with >= 2 requests running")
