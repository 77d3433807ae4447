"""A video's audio track heard with its frames, against transformers, where vLLM's caches and a
chunked prefill could pair or place the two wrongly: the text pipeline (tiny Qwen2.5-Omni thinker)
with its prefill cut in steps of 64 tokens, two videos a prompt (conftest's `chunked` server)."""

from __future__ import annotations

import base64

import openai
import pytest

from omni_server.api.video import decode_video_audio
from tests import reference
from tests.media import kept_frames, png, video_with_audio

MODEL = "omni-tiny"
TEXT = "What happens?"


@pytest.fixture(scope="module")
def client(chunked_server):
    return openai.OpenAI(base_url=f"{chunked_server.base_url}/v1", api_key="x", max_retries=0)


def _heard(url: str):
    return kept_frames(url), decode_video_audio(base64.b64decode(url.split(",", 1)[1]), target_rate=16000,
                                                max_seconds=60)


def _ask(client, urls: list[str], image: str | None = None, max_tokens: int = 8):
    content = ([{"type": "image_url", "image_url": {"url": image}}] if image else [])
    content += [{"type": "video_url", "video_url": {"url": u}} for u in urls] + [{"type": "text", "text": TEXT}]
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True, "mm_processor_kwargs": {"use_audio_in_video": True}})


def _transformers(model_dir, urls: list[str], image=None, max_tokens: int = 8) -> tuple[int, list[int]]:
    heard = [_heard(u) for u in urls]
    content = ([{"type": "image"}] if image is not None else []) + [{"type": "video"}] * len(urls)
    inputs = reference.omni_inputs(model_dir, [{"role": "user", "content": content + [{"type": "text", "text": TEXT}]}],
                                   audios=[a for _, a in heard], videos=[f for f, _ in heard],
                                   images=None if image is None else [image], use_audio_in_video=True)
    tokens = reference.thinker_greedy_inputs(model_dir, {**inputs, "use_audio_in_video": True}, max_tokens)
    return inputs["input_ids"].shape[1], tokens


def _check(client, model_dir, urls: list[str], image=None) -> None:
    resp = _ask(client, urls, None if image is None else image[0])
    n, tokens = _transformers(model_dir, urls, None if image is None else image[1])
    assert resp.usage.prompt_tokens == n
    assert resp.choices[0].model_extra["token_ids"] == tokens


@pytest.mark.parametrize("seed", [778, 779])
def test_a_prefill_cut_through_the_span_equals_transformers(client, tiny_models, seed):
    """~600 prompt tokens in 64-token steps: steps where a chunk's audio precedes the next chunk's
    frames (not interleaved within the step) were laid out in feature order by vLLM: frame
    embeddings on audio tokens, a different reply."""
    url, _ = video_with_audio(frames=10, fps=4.0, audio_s=3.5, seed=seed)
    _check(client, tiny_models["tiny-qwen2_5-omni"], [url])


def test_two_videos_and_an_image_equal_transformers(client, tiny_models):
    urls = [video_with_audio(frames=4, fps=4.0, audio_s=1.2, seed=5)[0],
            video_with_audio(frames=6, fps=4.0, audio_s=2.6, seed=6, tone_hz=660.0)[0]]
    _check(client, tiny_models["tiny-qwen2_5-omni"], urls, png(56, 56, seed=3))


def test_a_pair_seen_in_part_before_is_heard_as_sent(client, tiny_models):
    """vLLM keys a video's processed and encoded forms by its frames, and a track's by its samples,
    but each one's tokens depend on both: the same frames with another track took the first track's
    cached layout (another length: the engine failed, every request on it lost; the same length: the
    old track's reply), and new frames with a track seen before failed in the processor."""
    model_dir = tiny_models["tiny-qwen2_5-omni"]
    first = video_with_audio(frames=10, fps=4.0, audio_s=3.5, seed=41, tone_hz=2600.0)[0]
    _check(client, model_dir, [first])
    _check(client, model_dir, [video_with_audio(frames=10, fps=4.0, audio_s=2.0, seed=41, tone_hz=330.0)[0]])
    _check(client, model_dir, [video_with_audio(frames=10, fps=4.0, audio_s=3.5, seed=41, tone_hz=330.0)[0]])
    _check(client, model_dir, [video_with_audio(frames=10, fps=4.0, audio_s=3.5, seed=42, tone_hz=2600.0)[0]])
    before = _ask(client, [first])  # (the first pair again: its cached forms still serve it)
    assert before.usage.prompt_tokens_details.cached_tokens > 0
    assert before.choices[0].model_extra["token_ids"] == _transformers(model_dir, [first])[1]
