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


def test_streamed_chunks_build_only_their_own_rows(tiny_models):
    """Incremental: called with `since` (rows the talker holds), the processor returns the tail of
    what a call on the whole input so far returns, final rows (text end, pad) included."""
    model_dir = tiny_models["tiny-qwen2_5-omni"]
    thinker = read_config(str(model_dir)).thinker_config
    hidden = thinker.text_config.hidden_size if hasattr(thinker, "text_config") else thinker.hidden_size
    proc = processors.get("qwen2_5_omni.thinker_to_talker")
    assert proc.incremental
    ctx = SimpleNamespace(stage=SimpleNamespace(model=str(model_dir)), dtype=torch.float32)
    prompt_ids, reply = [11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27]
    rows = torch.randn(len(prompt_ids) + len(reply) - 1, hidden, generator=torch.Generator().manual_seed(0))

    def payload(n_out: int, final: bool) -> dict[int, StagePayload]:
        # Streamed: the rows of every fed position so far (the newest token's row comes a step later).
        n_rows = len(prompt_ids) + n_out - (1 if final else 0)
        return {0: StagePayload(request_id="r", source_stage=0, prompt_token_ids=prompt_ids,
                                output_token_ids=reply[:n_out], tensors={"hidden": rows[:n_rows]}, final=final)}

    start = proc(payload(2, False), ctx, {"voice": "Ethan"})
    given = start.step_embeds.shape[0]
    for n_out, final in ((4, False), (7, True)):
        whole = proc(payload(n_out, final), ctx, {"voice": "Ethan"})
        part = proc(payload(n_out, final), ctx, {"voice": "Ethan"}, since=given)
        assert part.prompt is None and part.step_offset == given
        # (Equal up to float rounding: a matmul over fewer rows may block its sums differently.)
        assert part.step_embeds.shape == whole.step_embeds[given:].shape and len(part.step_embeds) > 0
        assert (part.step_embeds - whole.step_embeds[given:]).abs().max() < 1e-5
        given = whole.step_embeds.shape[0]
    # Reply rows 1 .. n-2 (row 0 joins the prompt, the last token is never fed), text end, text pad.
    assert given == len(reply) - 2 + 2
