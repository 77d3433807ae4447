"""The Qwen3-Omni thinker stage emits the residual stream the talker reads (transformers'
hidden_states[accept_hidden_layer]), not its final normed states."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from tests.conftest import REPO, compiled_config

CONFIG = REPO / "tests" / "configs" / "qwen3_omni.yaml"


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@torch.inference_mode()
def test_thinker_stage_emits_the_talkers_layer(tiny_models, tmp_path, mode):
    """`compiled`: the compiled stack must run our forward, not the one vLLM's compile wrapper saw
    when the stack was built."""
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    model_dir = tiny_models["tiny-qwen3-omni-moe"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Say something about the sea."}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    n_out = 5
    config = CONFIG if mode == "eager" else compiled_config(CONFIG, tmp_path / "compiled.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.stage_probe", str(config), "0", str(tmp_path), "--processor",
         "qwen3_omni_moe.thinker_to_talker", "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(n_out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(str(tmp_path / "probe.0.safetensors"), "pt") as f:
        ours = f.get_tensor("hidden")
        out_ids = [int(t) for t in f.metadata()["output_token_ids"].split(",")]
        positions = f.get_tensor("mrope_positions")

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = copy.deepcopy(model.thinker.generation_config)
    config.eos_token_id, config.max_new_tokens, config.do_sample = None, n_out, False
    x = torch.tensor([ids])
    res = model.thinker.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=config,
                                 output_hidden_states=True, return_dict_in_generate=True)
    assert res.sequences[0, len(ids):].tolist() == out_ids
    layer = model.config.talker_config.accept_hidden_layer
    want = torch.cat([step[layer] for step in res.hidden_states], dim=1)[0]
    final = torch.cat([step[-1] for step in res.hidden_states], dim=1)[0]
    assert ours.shape == want.shape == (len(ids) + n_out - 1, want.shape[-1])
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours, final, atol=1e-2)  # not the final normed states
    # The prompt's M-RoPE positions travel with it (text: 1-D in all three sections).
    assert torch.equal(positions, torch.arange(len(ids)).expand(3, -1))
