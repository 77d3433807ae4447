"""Qwen3-Omni thinker -> talker input equals what transformers' generate() hands its talker."""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch

from omni_server.stage import processors
from omni_server.wire.messages import StagePayload
from tests import reference
from tests.media import tone_wav


@lru_cache(maxsize=None)
def _hf(model_dir):
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


@torch.inference_mode()
def _hf_talker_input(model_dir, inputs: dict, voice: str, max_new_tokens: int = 8):
    """(thinker payload as our thinker stage would send it, the talker.generate kwargs transformers built)."""
    model, _ = _hf(model_dir)
    result, talker_kwargs = reference.talker_call(model, inputs, speaker=voice, thinker_max_new_tokens=max_new_tokens,
                                                  thinker_do_sample=False, talker_max_new_tokens=4)
    n_prompt = inputs["input_ids"].shape[1]
    layer = model.config.talker_config.accept_hidden_layer
    hidden = torch.cat([step[layer] for step in result.hidden_states], dim=1)[0]  # prompt + generated - 1 rows
    ids = result.sequences[0].tolist()
    # The thinker prompt's M-RoPE positions, as our thinker stage sends them (its positions are
    # transformers': tests/test_e2e_qwen3_omni.py).
    audio = inputs.get("feature_attention_mask")
    positions, _ = model.thinker.get_rope_index(
        inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), inputs.get("attention_mask"),
        False, None if audio is None else audio.sum(-1))
    payload = StagePayload(request_id="r", source_stage=0, prompt_token_ids=ids[:n_prompt],
                           output_token_ids=ids[n_prompt:], tensors={"hidden": hidden, "mrope_positions": positions[:, 0]})
    return payload, talker_kwargs


def _talker_rope_index(model_dir, ref: dict) -> torch.Tensor:
    """The positions transformers' talker computes for its prompt ([3, n]), from its generate kwargs."""
    model, _ = _hf(model_dir)
    positions, _ = model.talker.get_rope_index(
        ref["talker_input_ids"], ref.get("image_grid_thw"), ref.get("video_grid_thw"), ref["attention_mask"],
        False, ref.get("audio_feature_lengths"), ref.get("video_second_per_grid"))
    return positions[:, 0]


def _ours(model_dir, payload, voice, **since):
    ctx = SimpleNamespace(stage=SimpleNamespace(model=str(model_dir)), dtype=torch.float32)
    return processors.get("qwen3_omni_moe.thinker_to_talker")({0: payload}, ctx, {"voice": voice}, **since)


def _check(model_dir, inputs, voice):
    payload, ref = _hf_talker_input(model_dir, inputs, voice)
    out = _ours(model_dir, payload, voice)
    want_prompt = ref["inputs_embeds"][0]
    # Per step: the reference's trailing rows, then tts_pad for ever (our runner repeats the last row).
    want_steps = torch.cat([ref["trailing_text_hidden"][0], ref["tts_pad_embed"][0]])
    assert out.prompt["prompt_embeds"].shape == want_prompt.shape
    torch.testing.assert_close(out.prompt["prompt_embeds"], want_prompt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.step_embeds, want_steps, rtol=1e-5, atol=1e-5)
    assert out.prompt["is_token_ids"] == [False] * want_prompt.shape[0]
    assert torch.equal(out.positions, _talker_rope_index(model_dir, ref))
    return payload, out


def test_text_prompt_multi_turn_with_system(tiny_models):
    model_dir = tiny_models["tiny-qwen3-omni-moe"]
    _, proc = _hf(model_dir)
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": "Hi there."},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Say something about the sea."}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = dict(proc(text=text, return_tensors="pt"))
    payload, out = _check(model_dir, inputs, "Chelsie")
    # System and earlier assistant turns are not part of the talker's prompt: both user turns + 9 rows.
    assert out.prompt["prompt_embeds"].shape[0] < len(payload.prompt_token_ids) + 9


def test_audio_prompt_reads_the_thinkers_hidden_rows_at_the_audio(tiny_models):
    model_dir = tiny_models["tiny-qwen3-omni-moe"]
    _, proc = _hf(model_dir)
    _, heard = tone_wav()
    text = proc.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "What do you hear?"}, {"type": "audio"}]}], add_generation_prompt=True, tokenize=False)
    inputs = dict(proc(text=text, audio=[heard], return_tensors="pt", padding=True))
    payload, out = _check(model_dir, inputs, "Ethan")
    # Without the hidden rows the media rows cannot be built.
    no_hidden = StagePayload(request_id="r", source_stage=0, prompt_token_ids=payload.prompt_token_ids,
                             output_token_ids=payload.output_token_ids, tensors={})
    with pytest.raises(ValueError, match="hidden states"):
        _ours(model_dir, no_hidden, "Ethan")


def test_image_prompt_gives_the_talker_its_3d_positions(tiny_models):
    """An image in a later user turn (after a system turn and an assistant reply, which the talker
    never sees): the talker's positions keep the image's 3-D grid, shifted back by the dropped tokens."""
    model_dir = tiny_models["tiny-qwen3-omni-moe"]
    _, proc = _hf(model_dir)
    rgb = (torch.arange(96 * 160 * 3) % 251).reshape(96, 160, 3).to(torch.uint8).numpy()
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": "Hi there."},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = dict(proc(text=text, images=[rgb], return_tensors="pt"))
    payload, out = _check(model_dir, inputs, "Ethan")
    assert not torch.equal(out.positions[1], out.positions[2])  # a real grid: height and width differ
    # Without positions from the thinker, plain ones (the talker numbers its prompt itself).
    bare = StagePayload(request_id="r", source_stage=0, prompt_token_ids=payload.prompt_token_ids,
                        output_token_ids=payload.output_token_ids, tensors={"hidden": payload.tensors["hidden"]})
    assert _ours(model_dir, bare, "Ethan").positions is None


def test_media_the_talker_never_sees_keys_its_prefix_cache_by_positions(tiny_models):
    """The talker's prefix cache keys blocks by its prompt rows' bytes. Text rows are the same after
    any history, and their positions shift only by what the talker prompt drops, one per token; an
    image in a dropped turn shifts them by its grid, so such a prompt is salted by its positions."""
    model_dir = tiny_models["tiny-qwen3-omni-moe"]
    _, proc = _hf(model_dir)
    rgb = (torch.arange(96 * 160 * 3) % 251).reshape(96, 160, 3).to(torch.uint8).numpy()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": "A pattern."},
                {"role": "user", "content": "Say something about the sea."}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    payload, out = _check(model_dir, dict(proc(text=text, images=[rgb], return_tensors="pt")), "Ethan")
    assert "cache_salt" not in out.prompt  # (the image is in the talker's prompt: its rows show it)
    # The same ids with the image's turn a system turn: the talker drops it, image and all.
    ids = list(payload.prompt_token_ids)
    user, system = proc.tokenizer.convert_tokens_to_ids(["user", "system"])
    ids[ids.index(user)] = system
    moved = StagePayload(request_id="r", source_stage=0, prompt_token_ids=ids, output_token_ids=payload.output_token_ids,
                         tensors=payload.tensors)
    salted = _ours(model_dir, moved, "Ethan")
    assert salted.prompt["cache_salt"].startswith("positions:")
    bare = StagePayload(request_id="r", source_stage=0, prompt_token_ids=ids, output_token_ids=payload.output_token_ids,
                        tensors={k: v for k, v in payload.tensors.items() if k != "mrope_positions"})
    assert "cache_salt" not in _ours(model_dir, bare, "Ethan").prompt  # (plain positions: the rows say it all)


def test_streamed_payload_starts_on_the_first_reply_token_and_grows(tiny_models):
    model_dir = tiny_models["tiny-qwen3-omni-moe"]
    _, proc = _hf(model_dir)
    text = proc.apply_chat_template([{"role": "user", "content": "Count to three."}], add_generation_prompt=True,
                                    tokenize=False)
    payload, full = _check(model_dir, dict(proc(text=text, return_tensors="pt")), "Aiden")

    def part(n_out):
        return StagePayload(request_id="r", source_stage=0, prompt_token_ids=payload.prompt_token_ids,
                            output_token_ids=payload.output_token_ids[:n_out], tensors={}, final=False)

    assert _ours(model_dir, part(0), "Aiden") is None  # no reply token yet
    for n_out in (1, 3, len(payload.output_token_ids)):
        out = _ours(model_dir, part(n_out), "Aiden")
        torch.testing.assert_close(out.prompt["prompt_embeds"], full.prompt["prompt_embeds"])
        # Rows settle one token late (the newest may be the last, which is never spoken).
        assert out.step_embeds.shape[0] == max(n_out - 2, 0)
        torch.testing.assert_close(out.step_embeds, full.step_embeds[:out.step_embeds.shape[0]])
    # Incremental (what the stage does once the talker started): only the rows past `since`.
    given = _ours(model_dir, part(1), "Aiden").step_embeds.shape[0]
    for n_out, final in ((3, False), (len(payload.output_token_ids), True)):
        p = StagePayload(request_id="r", source_stage=0, prompt_token_ids=payload.prompt_token_ids,
                         output_token_ids=payload.output_token_ids[:n_out], tensors={}, final=final)
        whole = _ours(model_dir, p, "Aiden")
        more = _ours(model_dir, p, "Aiden", since=given)
        assert more.prompt is None and more.step_offset == given and len(more.step_embeds) > 0
        torch.testing.assert_close(more.step_embeds, whole.step_embeds[given:])
        given = whole.step_embeds.shape[0]
    assert given == full.step_embeds.shape[0]  # (the final rows: tts end and pad)


def test_unknown_voice_names_the_valid_ones(tiny_models):
    model_dir = tiny_models["tiny-qwen3-omni-moe"]
    payload = StagePayload(request_id="r", source_stage=0, prompt_token_ids=[1, 2], output_token_ids=[3])
    with pytest.raises(ValueError, match="aiden.*chelsie.*ethan"):
        _ours(model_dir, payload, "Nobody")


def test_frameless_first_chunks_read_the_config_once(tiny_models, monkeypatch):
    """Every talker request's first chunk to code2wav carries no frame yet; the processor gives an
    empty [16, 0] input without parsing the checkpoint's config per request (16 parses held the
    code2wav loop 2.95 s at c=16 on the H200)."""
    from omni_server.models.qwen3_omni_moe import processors as qwen3

    model_dir = str(tiny_models["tiny-qwen3-omni-moe"])
    reads = []
    real = qwen3.read_config
    monkeypatch.setattr(qwen3, "read_config", lambda d: reads.append(d) or real(d))
    qwen3._code_groups.cache_clear()
    ctx = SimpleNamespace(stage=SimpleNamespace(model=model_dir), dtype=torch.float32)
    to_code2wav = processors.get("qwen3_omni_moe.talker_to_code2wav")
    for i in range(3):
        payload = StagePayload(request_id=f"r{i}", source_stage=1, prompt_token_ids=[1], output_token_ids=[5])
        data = to_code2wav({1: payload}, ctx, {}).data
        assert data["codes"].shape == (real(model_dir).talker_config.num_code_groups, 0)
    assert reads == [model_dir]
