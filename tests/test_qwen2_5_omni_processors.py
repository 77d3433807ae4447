"""qwen2_5_omni.thinker_to_talker: what the talker stage hands vLLM for one request."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from omni_server.models.checkpoint import read_config
from omni_server.stage import processors
from omni_server.wire.messages import StagePayload


def test_talker_prompt_carries_the_references_codec_ids_for_the_penalty(tiny_models):
    """The forward reads only our embeddings (`is_token_ids` all False), but vLLM's repetition
    penalty counts the prompt's token ids: they are the ids transformers gives its talker (codec
    mask per thinker prompt position, then codec pad, codec start), so a penalised sampled talker
    avoids what the reference's avoids (without ids vLLM would count a stale token table)."""
    model_dir = tiny_models["tiny-qwen2_5-omni"]
    cfg = read_config(str(model_dir))
    talker, thinker = cfg.talker_config, cfg.thinker_config
    hidden = thinker.text_config.hidden_size if hasattr(thinker, "text_config") else thinker.hidden_size
    prompt_ids, out_ids = [11, 12, 13, 14, 15], [21, 22, 23]
    payload = StagePayload(request_id="r", source_stage=0, prompt_token_ids=prompt_ids, output_token_ids=out_ids,
                           tensors={"hidden": torch.randn(len(prompt_ids) + len(out_ids) - 1, hidden)})
    ctx = SimpleNamespace(stage=SimpleNamespace(model=str(model_dir)), dtype=torch.float32)
    out = processors.get("qwen2_5_omni.thinker_to_talker")({0: payload}, ctx, {"voice": "Ethan"})
    ids = out.prompt["prompt_token_ids"]
    assert ids == [talker.tts_codec_mask_token_id] * 5 + [talker.tts_codec_pad_token_id,
                                                          talker.tts_codec_start_token_id]
    assert out.prompt["is_token_ids"] == [False] * 7
    assert out.prompt["prompt_embeds"].shape == (7, talker.hidden_size)
    # Per-step rows: reply positions 1 .. (the last output token is never fed), then text end, text pad.
    assert out.step_embeds.shape == (len(out_ids) - 2 + 2, talker.hidden_size)
