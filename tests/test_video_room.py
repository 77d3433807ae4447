"""Videos counted before vLLM's processor reads them: a prompt whose videos cannot fit the context is
refused up front (vLLM checks the length only after processing every frame), and the count is the
processor's own, to the token."""

from __future__ import annotations

import itertools
import re
import warnings

import numpy as np
import openai
import pytest

from omni_server.models.omni_media import video_tokens
from tests.media import kept_frames, mp4

MODEL = "omni-tiny"


def _processor(tiny_models, family: str):
    from transformers import AutoProcessor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoProcessor.from_pretrained(str(tiny_models[{"qwen2_5_omni": "tiny-qwen2_5-omni", "qwen3_omni_moe": "tiny-qwen3-omni-moe"}[family]]))


@pytest.mark.parametrize("name", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_the_count_is_the_processors(tiny_models, name):
    """Against transformers' processor (what vLLM expands a video's placeholder by) over frame counts
    odd and even, frames smaller than its least pixels, larger than its most, and thin ones."""
    processor = _processor(tiny_models, name)
    pad = "<|VIDEO|>" if name == "qwen2_5_omni" else "<|video_pad|>"
    merge = processor.video_processor.merge_size
    for frames, height, width in itertools.product([1, 2, 3, 8], [16, 33, 721, 1080], [17, 64, 1280, 1921]):
        if max(height, width) / min(height, width) > 200:
            continue
        video = np.zeros((frames, height, width, 3), np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = processor(text=[pad], videos=[video], return_tensors="np", fps=2.0)
        expected = int(np.prod(out["video_grid_thw"][0])) // merge ** 2
        assert video_tokens(processor, {"fps": 2.0}, frames, height, width) == expected, (frames, height, width)
        assert (out["input_ids"][0] == processor.tokenizer.convert_tokens_to_ids(pad)).sum() == expected
    # Audio in video adds the track's tokens beside the frames': the video's own count stays.
    assert video_tokens(processor, {"fps": 2.0, "use_audio_in_video": True, "second_per_grid_ts": [1.0]}, 4, 48, 64) \
        == video_tokens(processor, {"fps": 2.0}, 4, 48, 64)


def test_kwargs_that_change_the_layout_are_not_counted(tiny_models):
    """Sizes or sampling set by the config's `mm_processor_kwargs` are the processor's to apply: no
    count (vLLM's check after processing stands), never a wrong one; likewise a shape it refuses."""
    processor = _processor(tiny_models, "qwen2_5_omni")
    for kwargs in ({"max_pixels": 10000}, {"size": {"shortest_edge": 1, "longest_edge": 2}},
                   {"do_sample_frames": True}, {"min_pixels": 1}):
        assert video_tokens(processor, {"fps": 2.0, **kwargs}, 4, 48, 64) is None
    assert video_tokens(processor, {"fps": 2.0}, 4, 2, 900) is None  # (aspect ratio past 200)


def _client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def _ask(client, urls: list[str], max_tokens: int = 1):
    content = [{"type": "video_url", "video_url": {"url": u}} for u in urls] + [{"type": "text", "text": "What?"}]
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, temperature=0, extra_body={"modalities": ["text"]})


def _refused(client, urls: list[str], max_tokens: int = 1) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, urls, max_tokens)
    return str(e.value)


PER_PAIR = 140  # tokens of two 48x64 frames: grown to the processor's least pixels, 20x28 patches merged 2x2


def test_videos_past_the_context_are_refused_before_processing_and_the_rest_run(speech_server):
    """The default pipeline's 2048-token thinker: the longest video that fits runs, its prompt as
    long as counted; a frame pair more is refused by the count (vLLM's own refusal, after it
    processed every frame, reads "The decoder prompt"), and so is the fitting video with a
    max_tokens the context cannot add."""
    client, context = _client(speech_server), 2048  # (configs/default.yaml)
    one_pair, _ = mp4(2, fps=2.0)
    assert len(kept_frames(one_pair)) == 2
    base = _ask(client, [one_pair]).usage.prompt_tokens
    assert _ask(client, [mp4(4, fps=2.0, seed=1)[0]]).usage.prompt_tokens == base + PER_PAIR
    pairs = 1 + (context - 1 - base) // PER_PAIR  # the most that leave room for one token
    fits, _ = mp4(2 * pairs, fps=2.0, seed=2)
    assert _ask(client, [fits]).usage.prompt_tokens == base + (pairs - 1) * PER_PAIR <= context - 1
    for url, max_tokens in ((mp4(2 * pairs + 2, fps=2.0, seed=3)[0], 1), (fits, 2 * PER_PAIR)):
        message = _refused(client, [url], max_tokens)
        assert f"this model's context is {context} tokens: the prompt's video takes" in message, message
        assert ("max_tokens" in message) == (max_tokens > 1), message
    assert _ask(client, [one_pair]).usage.prompt_tokens == base  # (the server goes on)


def test_a_video_past_the_encoder_cache_is_refused_before_processing(chunked_server):
    """vLLM's encoder cache holds one item whole (sized at start from its own, smaller, count of a
    video: 896 tokens with the `chunked` server's 64-token steps); a video of more is refused by the
    count, alone or beside one that fits; the largest that fits runs."""
    client = _client(chunked_server)
    message = _refused(client, [mp4(2 * 8, fps=2.0, seed=5)[0]])
    found = re.search(r"a video of (\d+) tokens .* is more than this stage's encoder cache holds of one item, (\d+)",
                      message)
    assert found and int(found[1]) == 8 * PER_PAIR, message
    cache = int(found[2])
    fits, _ = mp4(2 * (cache // PER_PAIR), fps=2.0, seed=6)
    ran = _ask(client, [fits]).usage.prompt_tokens
    assert "encoder cache" in _refused(client, [fits, mp4(2 * (cache // PER_PAIR + 1), fps=2.0, seed=7)[0]])
    assert _ask(client, [fits]).usage.prompt_tokens == ran
