"""Prefix caching in a stage whose consumer reads its hidden states (stage/prefix_rows.py), in-process
through tests/stage_probe.py on the default pipeline's tiny thinker: a request that starts on a cache
hit still hands its consumer a row for every prompt position, the rows the whole prompt computed
from scratch gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "default.yaml"
BLOCK = 128  # the hits: whole blocks (one of 128 tokens on the CPU, 8 of 16 on a GPU)

PREFIX = [10 + (i * 37) % 900 for i in range(136)]  # more than a block, shared
FIRST, THEN = PREFIX + [5, 6, 7, 8], PREFIX + [901, 902, 903]


def _rows(out: Path, rid: str) -> tuple[torch.Tensor, list[int]]:
    """A request's rows as its consumer got them, and the engine steps its payloads left in."""
    parts, steps = [], []
    for f in sorted(out.glob(f"{rid}.*.safetensors"), key=lambda p: int(p.name.split(".")[1])):
        with safe_open(str(f), "pt") as t:
            parts.append(t.get_tensor("hidden"))
            steps.append(int(t.metadata()["step"]))
    return torch.cat(parts), steps


@pytest.mark.parametrize("stream", [0, 4])
def test_a_cache_hit_still_sends_every_prompt_row(tmp_path, stream):
    n_out = 5
    proc = subprocess.run(
        [sys.executable, "-m", "tests.stage_probe", str(CONFIG), "0", str(tmp_path), "--processor",
         "hidden_to_embeds", "--prompt-ids", ",".join(map(str, FIRST)), "--then-prompt-ids",
         ",".join(map(str, THEN)), "--max-tokens", str(n_out), *(["--stream", str(stream)] if stream else [])],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cached = json.loads((tmp_path / "cached.json").read_text())
    assert cached == {"probe": 0, "plain": 0, "then": BLOCK, "cold": 0, "twin_a": 0, "twin_b": BLOCK}
    (then, _), (cold, _), (first, _) = (_rows(tmp_path, r) for r in ("then", "cold", "probe"))
    assert then.shape == cold.shape == (len(THEN) + n_out - 1, then.shape[1])
    # The cached block's rows are the first request's; the rest as computed from scratch.
    assert torch.equal(then[:BLOCK], first[:BLOCK])
    torch.testing.assert_close(then, cold, rtol=1e-4, atol=1e-5)  # (another batch: other rounding)
    # twin_b hit the block twin_a computed in the same step (their payloads leave together): the
    # rows are written before they are read.
    (a, a_steps), (b, b_steps) = _rows(tmp_path, "twin_a"), _rows(tmp_path, "twin_b")
    assert a_steps == b_steps and b.shape[0] == len(THEN) + 2 + n_out - 1
    assert torch.equal(a[:BLOCK], b[:BLOCK])
    torch.testing.assert_close(a[:len(THEN)], b[:len(THEN)], rtol=1e-4, atol=1e-5)
    # The stage's KV budget holds its KV and the rows beside it: as many tokens as fit in both.
    kv = json.loads((tmp_path / "kv.json").read_text())
    per_token = kv["kv_bytes_per_token"] + kv["row_bytes"]
    assert kv["tokens"] * per_token <= kv["budget"] < (kv["tokens"] + BLOCK) * per_token
