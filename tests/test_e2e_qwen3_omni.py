"""Qwen3-Omni-MoE thinker served by vLLM through the real server, checked against transformers.

The tiny random-weight checkpoint (omni_server.models.tiny_checkpoints.build_tiny_qwen3_omni) is
served as thinker (text out) + talker decoder (codes in `omni_outputs`) (tests/configs/qwen3_omni.yaml);
the thinker's greedy tokens must be
transformers' Qwen3OmniMoeThinkerForConditionalGeneration.generate tokens on the same prompt ids
(float32, CPU); with an input_audio or image_url part, transformers runs on the checkpoint's own
Qwen3OmniMoeProcessor's inputs for the same samples / pixels.  This module starts its own server:
the session fixtures in conftest.py serve the Qwen2.5-Omni pipelines.
"""

from __future__ import annotations

import contextlib
import copy
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from tests.media import kept_frames, mp4, png, tone_wav, video_with_audio
from tests.conftest import MODELS, REPO, STARTUP_TIMEOUT, Server, compiled_config, edited_config

MODEL = "omni-tiny-qwen3"
CONFIG = REPO / "tests" / "configs" / "qwen3_omni.yaml"
MESSAGES = [{"role": "user", "content": "Tell me about the weather in the city today."}]
OTHER_MESSAGES = [
    {"role": "system", "content": "Keep the answers short and polite."},
    {"role": "user", "content": "Can you tell me a story about a robot who learns to paint flowers?"},
]
MAX_TOKENS = 16


def _model_dir() -> Path:
    from omni_server.models.tiny_checkpoints import TINY_QWEN3_OMNI

    return MODELS / TINY_QWEN3_OMNI


# ---------------------------------------------------------------------------------------------
# transformers reference
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _hf_thinker(model_dir: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return model.thinker.eval()


@lru_cache(maxsize=None)
def _hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@torch.inference_mode()
def _hf_thinker_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy thinker tokens, never stopping early (the server runs with ignore_eos)."""
    model = _hf_thinker(model_dir)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.max_new_tokens = max_new_tokens
    config.do_sample = False
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


@lru_cache(maxsize=None)
def _hf_processor(model_dir: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def _hf_media_inputs(model_dir: Path, content: list[dict], audios: list | None = None,
                     images: list | None = None) -> dict:
    """The checkpoint's own Qwen3OmniMoeProcessor on one user message whose media parts are
    placeholders ({"type": "audio"} / {"type": "image"}), with 16 kHz float audio / RGB uint8 images."""
    proc = _hf_processor(model_dir)
    assert type(proc).__name__ == "Qwen3OmniMoeProcessor"
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                    tokenize=False)
    return dict(proc(text=text, audio=audios, images=images, return_tensors="pt", padding=True))


@torch.inference_mode()
def _hf_thinker_greedy_inputs(model_dir: Path, inputs: dict, max_new_tokens: int) -> list[int]:
    """transformers' greedy thinker tokens on processor inputs (features, expanded placeholders)."""
    model = _hf_thinker(model_dir)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.max_new_tokens = max_new_tokens
    config.do_sample = False
    out = model.generate(**inputs, generation_config=config)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _collapse(ids: list[int], pad: int) -> list[int]:
    """`ids` with each run of the placeholder `pad` cut to one token (the template's unexpanded form)."""
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _serving(config: Path, log: Path, args: list[str] = ()):
    from omni_server.models.tiny_checkpoints import ensure_all

    ensure_all(MODELS)
    server = Server(config, log, args=list(args))
    try:
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT)
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"server exit code {code}:\n{server.log_tail()}"


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    # The thinker's prefill in steps of 64 tokens, as long prompts run on GPUs: media spans cut across
    # steps (a video's frames and its audio track, an image's rows and their deepstack rows).
    chunked = ["--stage-arg", "thinker.max_num_batched_tokens=64", "--stage-arg", "thinker.enable_chunked_prefill=true"]
    with _serving(CONFIG, tmp_path_factory.mktemp("qwen3-omni-logs") / "qwen3_omni_text.log", chunked) as server:
        yield server


@pytest.fixture(scope="module")
def client(qwen3_server):
    return openai.OpenAI(base_url=f"{qwen3_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def compiled_client(tmp_path):
    """The same pipeline as the real config runs it: thinker and talker under vLLM's torch.compile,
    the talker starting on the thinker's first reply token and reading the rest as it comes
    (`input_mode: stream`), and allowed more codes than the reply has tokens, so that it reads the
    trailing tts_eos / tts_pad rows too."""
    from omni_server.config import load_config

    assert load_config(REPO / "configs" / "qwen3_omni.yaml").stage(1).input_mode == "stream"

    def streamed(stage: dict) -> None:
        if stage["name"] == "talker":
            stage["input_mode"] = "stream"
            stage["default_sampling"]["max_tokens"] = MAX_TOKENS + 8

    streamed_config = edited_config(CONFIG, tmp_path / "streamed.yaml", streamed)
    with _serving(compiled_config(streamed_config, tmp_path / "compiled.yaml"), tmp_path / "qwen3_compiled.log") as server:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def sampled_client(tmp_path):
    """The test pipeline with configs/qwen3_omni.yaml's talker sampling (transformers' generate()
    defaults: temperature 0.9, top-k 50, repetition penalty 1.05)."""
    from omni_server.config import load_config

    real = load_config(REPO / "configs" / "qwen3_omni.yaml").stage(1)
    sampling = real.default_sampling.model_dump(exclude_none=True, exclude={"max_tokens"})
    assert real.name == "talker" and sampling["temperature"] == 0.9 and sampling["top_k"] == 50

    def sampled(stage: dict) -> None:
        if stage["name"] == "talker":
            stage["default_sampling"].update(sampling)

    config = edited_config(CONFIG, tmp_path / "sampled.yaml", sampled)
    with _serving(config, tmp_path / "qwen3_sampled.log") as server:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _greedy_chat(client, messages):
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          modalities=["text"],  # text only: talker and code2wav skip it
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    return resp, resp.model_extra["prompt_token_ids"], resp.choices[0].model_extra["token_ids"]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_tiny_checkpoint_ids_match_its_tokenizer():
    """The config's special ids are the tokenizer's ids of the real Qwen3-Omni tokens."""
    from transformers import AutoConfig

    from omni_server.models.tiny_checkpoints import ensure_all

    ensure_all(MODELS)
    config = AutoConfig.from_pretrained(_model_dir())
    tok = _hf_tokenizer(_model_dir())
    thinker = config.thinker_config
    expected = {
        "<|audio_pad|>": thinker.audio_token_id,
        "<|image_pad|>": thinker.image_token_id,
        "<|video_pad|>": thinker.video_token_id,
        "<|audio_start|>": thinker.audio_start_token_id,
        "<|vision_start|>": thinker.vision_start_token_id,
        "<|im_start|>": config.im_start_token_id,
        "<|im_end|>": config.im_end_token_id,
        "<tts_pad>": config.tts_pad_token_id,
        "<tts_text_bos>": config.tts_bos_token_id,
        "<tts_text_eod>": config.tts_eos_token_id,
        "user": config.user_token_id,
        "system": config.system_token_id,
        "assistant": config.assistant_token_id,
    }
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert len(tok) == thinker.text_config.vocab_size
    assert tok.eos_token_id == config.im_end_token_id


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_chat_equals_transformers(client):
    resp, prompt_ids, tokens = _greedy_chat(client, MESSAGES)
    # The api renders the checkpoint's own chat template, as transformers does.
    tok = _hf_tokenizer(_model_dir())
    assert prompt_ids == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
    expected = _hf_thinker_greedy(_model_dir(), prompt_ids, MAX_TOKENS)
    assert len(expected) == MAX_TOKENS
    assert tokens == expected
    assert len(set(tokens)) > 1, "degenerate reference: the tiny thinker repeats one token"
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == MAX_TOKENS
    # Random tokens can end inside a multi-byte character: vLLM's incremental detokenizer holds
    # those bytes back, transformers' decode renders them as U+FFFD.
    assert choice.message.content == tok.decode(expected, skip_special_tokens=True).rstrip("\ufffd")


def test_concurrent_chats_equal_transformers(client):
    """Two different prompts batched together (MoE routing per token) each match transformers."""
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda m: _greedy_chat(client, m), [MESSAGES, OTHER_MESSAGES]))
    (_, prompt_a, tokens_a), (_, prompt_b, tokens_b) = results
    assert prompt_a != prompt_b
    assert tokens_a == _hf_thinker_greedy(_model_dir(), prompt_a, MAX_TOKENS)
    assert tokens_b == _hf_thinker_greedy(_model_dir(), prompt_b, MAX_TOKENS)
    assert tokens_a != tokens_b


def _check_media_chat(client, content: list[dict], ref_content: list[dict], pad_token: str, **media):
    """One greedy chat with media through the server against transformers on the processor's inputs;
    returns the processor's inputs."""
    resp, prompt_ids, tokens = _greedy_chat(client, [{"role": "user", "content": content}])
    model_dir = _model_dir()
    inputs = _hf_media_inputs(model_dir, ref_content, **media)
    ref_ids = inputs["input_ids"][0].tolist()
    pad = _hf_tokenizer(model_dir).convert_tokens_to_ids(pad_token)
    # The server reports the template's prompt (one placeholder per media part); the processor's is
    # the same with the placeholder expanded to one token per embedding row.
    assert prompt_ids.count(pad) == 1
    assert prompt_ids == _collapse(ref_ids, pad)
    assert ref_ids.count(pad) > 1
    expected = _hf_thinker_greedy_inputs(model_dir, inputs, MAX_TOKENS)
    assert len(expected) == MAX_TOKENS
    assert tokens == expected
    assert len(set(tokens)) > 1, "degenerate reference: the tiny thinker repeats one token"
    assert resp.choices[0].finish_reason == "length"
    return inputs


def test_chat_with_audio_input_equals_transformers(client):
    """An OpenAI input_audio part (wav, decoded to 16 kHz) goes through vLLM's Qwen3-Omni processor
    and audio tower; the greedy tokens are transformers' on the same samples."""
    b64, heard = tone_wav(1.5)
    content = [{"type": "text", "text": "What do you hear?"},
               {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}]
    inputs = _check_media_chat(client, content, [{"type": "text", "text": "What do you hear?"}, {"type": "audio"}],
                               "<|audio_pad|>", audios=[heard])
    assert inputs["input_features"].shape[-1] == 150  # 1.5 s of 10 ms mel frames, no padding


def test_a_clip_longer_than_30_s_is_heard_whole(client):
    """Qwen3-Omni's processor reads a clip whole (no truncation, unlike Qwen2.5-Omni's 30 s): a 40 s
    clip is taken, and its prompt holds more audio tokens than a 30 s one."""
    def prompt_tokens(seconds: float) -> int:
        b64, _ = tone_wav(seconds)
        return client.chat.completions.create(model=MODEL, modalities=["text"], max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}]}],
        ).usage.prompt_tokens

    assert prompt_tokens(40.0) > prompt_tokens(30.0) + 100  # (~13 audio tokens a second)


# vLLM 0.26.0's Qwen3OmniMoeThinkerForConditionalGeneration.get_mrope_input_positions reads each
# placeholder's mm_position.offset as the index of its <|vision_start|> / <|audio_start|> token (it
# gives that token a text position, then the grid, then <|vision_end|>), but the offset its processor
# records is that of the first <|image_pad|> (the PromptReplacement target is the pad token alone).
# So the image's 3-D grid starts one token late: the first pad gets a text position and the grid
# covers pads 2..n plus <|vision_end|>.  Audio positions are 1-D and sequential, so the same shift is
# invisible there; Qwen2.5-Omni's implementation reads the offset as the first pad and is right.
IMAGE_TEXT = "What is this?"


def _image_chat(client):
    url, rgb = png(160, 96)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": IMAGE_TEXT}]
    return content, [{"type": "image"}, {"type": "text", "text": IMAGE_TEXT}], rgb


def test_chat_with_image_equals_transformers(client):
    """An image_url PNG data URL (non-square, so the 3-D rope positions differ in height and width)
    goes through vLLM's processor and vision tower; the greedy tokens must be transformers'."""
    content, ref_content, rgb = _image_chat(client)
    inputs = _check_media_chat(client, content, ref_content, "<|image_pad|>", images=[rgb])
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 10]]  # 16-pixel patches, merged 2 x 2 -> 15 tokens


def _vllm_image_positions(prompt_len: int, pad_offset: int, grid_thw: list[int], merge: int,
                          per_second: int) -> torch.Tensor:
    """The M-RoPE positions vLLM 0.26.0 computes for one image, from its own code, given the offset
    its processor records (the first pad)."""
    from types import SimpleNamespace

    from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3OmniMoeThinkerForConditionalGeneration

    t, h, w = grid_thw
    feature = (pad_offset, "image", {"grid_t": t, "grid_h": h // merge, "grid_w": w // merge, "t_factor": per_second})
    stub = SimpleNamespace(iter_mm_features=lambda _features: iter([feature]))
    positions, _ = Qwen3OmniMoeThinkerForConditionalGeneration.get_mrope_input_positions(
        stub, [0] * prompt_len, [])
    return positions


def test_vllm_base_positions_are_one_token_late(client):
    """Why the stage runs `model_class: qwen3_omni_moe.thinker`: vLLM 0.26.0's own Qwen3-Omni thinker
    computes the image's M-RoPE grid one token late (it reads the first pad's offset as the start
    token's), so its positions differ from transformers' exactly inside the placeholder; ours (the
    image chat above equals transformers) moves the offset back."""
    content, ref_content, rgb = _image_chat(client)
    _, prompt_ids, _ = _greedy_chat(client, [{"role": "user", "content": content}])
    model_dir = _model_dir()
    inputs = _hf_media_inputs(model_dir, ref_content, images=[rgb])
    ids = inputs["input_ids"][0].tolist()
    pad = _hf_tokenizer(model_dir).convert_tokens_to_ids("<|image_pad|>")
    assert prompt_ids == _collapse(ids, pad)
    thinker = _hf_thinker(model_dir)
    hf_pos, _ = thinker.get_rope_index(inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"],
                                       attention_mask=inputs["attention_mask"])
    hf_pos = hf_pos[:, 0].long()
    first, n = ids.index(pad), ids.count(pad)
    vllm_pos = _vllm_image_positions(len(ids), first, inputs["image_grid_thw"][0].tolist(),
                                     thinker.config.vision_config.spatial_merge_size,
                                     thinker.config.position_id_per_seconds)
    differ = (vllm_pos != hf_pos).any(0).nonzero().flatten().tolist()
    assert differ and first <= differ[0] and differ[-1] <= first + n  # the pads and <|vision_end|> only
    # transformers' grid starts at the first pad; vLLM's one token later.
    assert hf_pos[:, first].tolist() == hf_pos[:, first - 1].add(1).tolist()
    assert vllm_pos[:, first + 1:first + n + 1].tolist() == hf_pos[:, first:first + n].add(1).tolist()
    # Given the start token's offset instead, vLLM's own code yields transformers' positions.
    fixed = _vllm_image_positions(len(ids), first - 1, inputs["image_grid_thw"][0].tolist(),
                                  thinker.config.vision_config.spatial_merge_size,
                                  thinker.config.position_id_per_seconds)
    assert torch.equal(fixed, hf_pos)


@torch.inference_mode()
def _hf_speech(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, voice: str, talker_max: int,
               media: dict | None = None):
    """transformers' whole pipeline, greedy (thinker never stopping early): (thinker tokens, talker
    codes c0, frames [n, 16], waveform). `media`: the processor's other inputs (pixel_values, ...).

    transformers 5.17's talker config has no `audio_config`, which its rope index reads on an
    audio-in-video prompt (its generate raises AttributeError there): lent the thinker's (it only
    sizes audio whose positions are sequential anyway; tests/test_audio_in_video_positions.py)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    if (media or {}).get("use_audio_in_video"):
        model.talker.config.audio_config = model.config.thinker_config.audio_config
    model.thinker.generation_config.eos_token_id = None
    seen = {}
    talker_generate = model.talker.generate

    def talker(**kwargs):
        seen["talker"] = talker_generate(**kwargs)
        return seen["talker"]

    model.talker.generate = talker
    ids = torch.tensor([prompt_ids])
    sequences, wave = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker=voice, **(media or {}),
                                     thinker_max_new_tokens=max_new_tokens, thinker_do_sample=False,
                                     talker_do_sample=False, talker_repetition_penalty=1.0,
                                     talker_max_new_tokens=talker_max)
    result = seen["talker"]
    frames = torch.stack([hid[-1] for hid in result.hidden_states if hid[-1] is not None], dim=1)[0]
    return (sequences[0, len(prompt_ids):].tolist(), result.sequences[0, -talker_max:].tolist(), frames,
            wave.reshape(-1).float())


def test_speech_equals_transformers(client):
    """Thinker -> talker (decoder + code predictor, frame by frame) -> code2wav, greedy: the reply,
    the talker's codes and the waveform are transformers' own pipeline's (without the code
    predictor's residual embeddings the codes part from transformers' at the second one)."""
    _check_speech(client)


def _check_speech(client):
    import base64

    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "pcm16"}, extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = resp.model_extra["prompt_token_ids"]
    codes = resp.model_extra["omni_outputs"]["talker"]["token_ids"]
    pcm = np.frombuffer(base64.b64decode(resp.choices[0].message.audio.data), dtype="<i2").astype(np.float32) / 32768
    thinker, ref_codes, frames, wave = _hf_speech(_model_dir(), prompt_ids, MAX_TOKENS, "chelsie", len(codes))
    assert resp.choices[0].model_extra["token_ids"] == thinker
    assert codes == ref_codes, (codes, ref_codes)
    assert frames.shape == (len(codes) - 1, 16)  # the last sampled code is never fed: n - 1 frames
    assert pcm.shape == wave.shape, (pcm.shape, wave.shape)
    assert np.abs(pcm - wave.clamp(-1, 1).numpy()).max() < 2e-4  # pcm16 rounding
    return codes


def test_speech_usage_counts_the_frames_spoken(qwen3_server):
    """/v1/audio/speech (streamed through code2wav): `usage.output_tokens` counts the codec frames
    decoded (each 16 codebooks' codes), as many as the audio's length holds (code2wav's upsampling)."""
    import base64
    import json
    import math

    import httpx

    config = json.loads((_model_dir() / "config.json").read_text())["code2wav_config"]
    per_frame = math.prod(config["upsample_rates"]) * math.prod(config["upsampling_ratios"])
    body = {"model": MODEL, "input": "The weather is fine today.", "voice": "chelsie", "response_format": "pcm",
            "stream_format": "sse"}
    pcm, usage = b"", None
    with httpx.stream("POST", f"{qwen3_server.base_url}/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "speech.audio.delta":
                    pcm += base64.b64decode(event["audio"])
                else:
                    usage = event["usage"]
    frames = usage["output_tokens"]  # (the decoder's convolutions trim a few hundred samples in all)
    assert frames > 0 and per_frame * (frames - 1) < len(pcm) // 2 <= per_frame * frames


def test_repeated_turn_starts_on_the_talkers_prefix_cache(client, qwen3_server):
    """The same long speech turn again: the talker's prompt (the user turn's rows, then the
    assistant's) starts on its own prefix cache, and codes and waveform are still transformers'."""
    import base64

    story = " ".join(["The lighthouse keeper wrote down every ship that passed the point."] * 12)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": story}], max_tokens=MAX_TOKENS, temperature=0,
                  modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    client.chat.completions.create(**kwargs)
    before = qwen3_server.stats(1)["cached_tokens"]
    resp = client.chat.completions.create(**kwargs)
    assert qwen3_server.stats(1)["cached_tokens"] - before >= 128
    codes = resp.model_extra["omni_outputs"]["talker"]["token_ids"]
    thinker, ref_codes, _, wave = _hf_speech(_model_dir(), resp.model_extra["prompt_token_ids"], MAX_TOKENS, "ethan",
                                             len(codes))
    assert resp.choices[0].model_extra["token_ids"] == thinker
    assert codes == ref_codes, (codes, ref_codes)
    pcm = np.frombuffer(base64.b64decode(resp.choices[0].message.audio.data), dtype="<i2").astype(np.float32) / 32768
    assert pcm.shape == wave.shape and np.abs(pcm - wave.clamp(-1, 1).numpy()).max() < 2e-4


def test_speech_about_an_image_equals_transformers(client):
    """With an image in the prompt the talker's positions are 3-D (the image's grid, from the
    thinker's positions): its codes and the waveform are still transformers'."""
    import base64

    content, ref_content, rgb = _image_chat(client)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
        extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = resp.model_extra["prompt_token_ids"]
    codes = resp.model_extra["omni_outputs"]["talker"]["token_ids"]
    inputs = _hf_media_inputs(_model_dir(), ref_content, images=[rgb])
    ref_ids = inputs["input_ids"][0].tolist()  # (the placeholder expanded: one pad per image row)
    assert prompt_ids == _collapse(ref_ids, _hf_tokenizer(_model_dir()).convert_tokens_to_ids("<|image_pad|>"))
    media = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}
    thinker, ref_codes, _, wave = _hf_speech(_model_dir(), ref_ids, MAX_TOKENS, "ethan", len(codes), media)
    assert resp.choices[0].model_extra["token_ids"] == thinker
    assert codes == ref_codes, (codes, ref_codes)
    pcm = np.frombuffer(base64.b64decode(resp.choices[0].message.audio.data), dtype="<i2").astype(np.float32) / 32768
    assert pcm.shape == wave.shape and np.abs(pcm - wave.clamp(-1, 1).numpy()).max() < 2e-4


def test_speech_about_a_video_equals_transformers(client):
    """A video_url part: frames kept at 2 a second, and the processor told that rate (Qwen3-Omni's
    assumes 1 a second: the video's time positions would be stretched twice); thinker, talker codes
    and waveform equal transformers' on the same frames at fps 2."""
    import base64

    url, frames = mp4(6, fps=2.0, width=160, height=96)
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": IMAGE_TEXT}]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
        extra_body={"return_token_ids": True, "ignore_eos": True})
    codes = resp.model_extra["omni_outputs"]["talker"]["token_ids"]
    proc = _hf_processor(_model_dir())
    message = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": IMAGE_TEXT}]}
    text = proc.apply_chat_template([message], add_generation_prompt=True, tokenize=False)
    inputs = dict(proc(text=text, videos=[frames], fps=2.0, return_tensors="pt", padding=True))
    assert inputs["video_second_per_grid"].tolist() == [1.0]  # 2 frames per temporal patch, 2 a second
    ref_ids = inputs["input_ids"][0].tolist()
    assert resp.usage.prompt_tokens == len(ref_ids)
    media = {k: inputs[k] for k in ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")}
    thinker, ref_codes, _, wave = _hf_speech(_model_dir(), ref_ids, MAX_TOKENS, "ethan", len(codes), media)
    assert resp.choices[0].model_extra["token_ids"] == thinker
    assert codes == ref_codes, (codes, ref_codes)
    pcm = np.frombuffer(base64.b64decode(resp.choices[0].message.audio.data), dtype="<i2").astype(np.float32) / 32768
    assert pcm.shape == wave.shape and np.abs(pcm - wave.clamp(-1, 1).numpy()).max() < 2e-4


def test_speech_hearing_a_videos_audio_equals_transformers(client):
    """`use_audio_in_video`: the track's tokens merged with the frames' by time (13 positions a
    second; the processor told the api's frame rate and its 1 s per temporal patch); thinker, talker
    codes (transformers' talker positions are sequential in this mode: generate does not tell it)
    and waveform equal transformers' on the frames and the track the server decodes."""
    import base64

    from omni_server.api.video import decode_video_audio

    url, _ = video_with_audio(frames=6, fps=2.0, audio_s=2.2, container="webm", rate=48000, width=160, height=96)
    frames, track = kept_frames(url), decode_video_audio(base64.b64decode(url.split(",", 1)[1]), target_rate=16000,
                                                         max_seconds=60)
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": IMAGE_TEXT}]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
        extra_body={"return_token_ids": True, "ignore_eos": True, "mm_processor_kwargs": {"use_audio_in_video": True}})
    codes = resp.model_extra["omni_outputs"]["talker"]["token_ids"]
    proc = _hf_processor(_model_dir())
    message = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": IMAGE_TEXT}]}
    text = proc.apply_chat_template([message], add_generation_prompt=True, tokenize=False)
    inputs = dict(proc(text=text, audio=[track], videos=[frames], fps=2.0, use_audio_in_video=True,
                       return_tensors="pt", padding=True))
    ref_ids = inputs["input_ids"][0].tolist()
    assert resp.usage.prompt_tokens == len(ref_ids)
    media = {k: inputs[k] for k in ("pixel_values_videos", "video_grid_thw", "video_second_per_grid",
                                    "input_features", "feature_attention_mask")}
    thinker, ref_codes, _, wave = _hf_speech(_model_dir(), ref_ids, MAX_TOKENS, "ethan", len(codes),
                                             {**media, "use_audio_in_video": True})
    assert resp.choices[0].model_extra["token_ids"] == thinker
    assert codes == ref_codes, (codes, ref_codes)
    pcm = np.frombuffer(base64.b64decode(resp.choices[0].message.audio.data), dtype="<i2").astype(np.float32) / 32768
    assert pcm.shape == wave.shape and np.abs(pcm - wave.clamp(-1, 1).numpy()).max() < 2e-4


def test_streamed_speech_arrives_in_pieces_equal_to_the_whole(client):
    """code2wav decodes the talker's frames window by window as they arrive (input_mode: stream):
    the SSE audio pieces concatenate to exactly the unstreamed audio of the same request."""
    import base64

    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                  modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
                  extra_body={"ignore_eos": True})
    pieces = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.delta.audio and choice.delta.audio.data:
                pieces.append(base64.b64decode(choice.delta.audio.data))
    whole = base64.b64decode(client.chat.completions.create(**kwargs).choices[0].message.audio.data)
    assert len(pieces) >= 2, "audio arrived in one piece"
    assert b"".join(pieces) == whole and len(whole) > 0


def test_compiled_streamed_speech_equals_transformers(compiled_client):
    """The same under torch.compile with the talker streaming in: the thinker's compiled stack still
    returns the talker's layer, the talker's compiled decoder takes any token count with its (3,
    tokens) M-RoPE positions, and its input rows, given as the thinker makes them, are the whole
    reply's (past its end too: the codes outnumber the reply's tokens)."""
    codes = _check_speech(compiled_client)
    assert len(codes) > MAX_TOKENS


def test_sampled_talker_follows_the_seed(sampled_client):
    """A sampling talker (the real config's settings) draws its codes and the code predictor's from
    the request's seed: the same seed speaks the same codes and waveform, another seed other codes,
    while the greedy thinker's reply stays the same."""

    def speak(seed: int):
        resp = sampled_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, seed=seed,
            modalities=["text", "audio"], audio={"voice": "chelsie", "format": "pcm16"},
            extra_body={"return_token_ids": True, "ignore_eos": True})
        codes = resp.model_extra["omni_outputs"]["talker"]["token_ids"]
        return resp.choices[0].model_extra["token_ids"], codes, resp.choices[0].message.audio.data

    first, again, other = speak(7), speak(7), speak(8)
    assert first == again
    assert other[0] == first[0] and other[1] != first[1] and other[2] != first[2]
    assert len(first[1]) > 1 and len(first[2]) > 0 and all(0 <= c < 3072 for c in first[1] + other[1])
