"""`n > 1` chat choices through the real servers and the official openai client: each choice an
independent request of the same prompt (choice i seeded with seed + i), gathered or streamed as one
response, and every one of them gone from every stage afterwards, whatever happened. (n > 8 is a
400: test_e2e_chat; the limit's count, a refused submission and the merged stream's error and
abort paths: test_api_unit.)"""

from __future__ import annotations

import base64
import io
import time
from collections import defaultdict

import httpx
import openai
import pytest
import soundfile as sf

MODEL = "omni-tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the weather in the city today."}]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=f"{text_server.base_url}/v1", api_key="unused", max_retries=0)


def _create(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def _stages_empty(server, stages: range, timeout: float = 20.0) -> None:
    """No stage holds a request (aborted ones go within a moment)."""
    deadline = time.monotonic() + timeout
    while any(server.stats(i)["request_ids"] for i in stages) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(server.stats(i)["request_ids"] for i in stages), [server.stats(i) for i in stages]


def test_greedy_choices_all_equal_the_single_reply(client, text_server):
    one = _create(client, max_tokens=12, temperature=0, extra_body=IDS)
    three = _create(client, max_tokens=12, temperature=0, n=3, extra_body=IDS)
    assert [c.index for c in three.choices] == [0, 1, 2]
    for c in three.choices:
        assert c.message.content == one.choices[0].message.content
        assert _ids(c) == _ids(one.choices[0]) and c.finish_reason == one.choices[0].finish_reason
    # OpenAI's usage: the prompt counted once, the completions summed.
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens
    assert three.model_extra["prompt_token_ids"] == one.model_extra["prompt_token_ids"]
    _stages_empty(text_server, range(1))


def test_seeded_choice_i_equals_a_single_reply_seeded_seed_plus_i(client, text_server):
    kw = dict(max_tokens=16, temperature=1.0, extra_body=IDS)
    two = _create(client, n=2, seed=100, **kw)
    singles = [_create(client, seed=100 + i, **kw).choices[0] for i in range(2)]
    assert [_ids(c) for c in two.choices] == [_ids(c) for c in singles]
    assert [c.message.content for c in two.choices] == [c.message.content for c in singles]
    assert _ids(two.choices[0]) != _ids(two.choices[1])  # independent samples
    assert two.usage.completion_tokens == sum(len(_ids(c)) for c in two.choices)
    assert [_ids(c) for c in _create(client, n=2, seed=100, **kw).choices] == [_ids(c) for c in two.choices]
    _stages_empty(text_server, range(1))


def test_stream_reassembles_to_the_whole(client, text_server):
    kw = dict(n=2, max_tokens=16, temperature=1.0, seed=7)
    whole = _create(client, **kw)
    chunks = list(_create(client, **kw, stream=True, stream_options={"include_usage": True}))
    text, roles, finishes = defaultdict(str), defaultdict(int), defaultdict(list)
    for chunk in chunks:
        assert len(chunk.choices) <= 1  # one choice a chunk, named by its index
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert dict(text) == {c.index: c.message.content for c in whole.choices}
    assert dict(roles) == {0: 1, 1: 1}
    assert dict(finishes) == {c.index: [c.finish_reason] for c in whole.choices}
    usage = [c for c in chunks if c.usage is not None]
    assert usage == [chunks[-1]] and chunks[-1].choices == []  # one usage chunk, after every choice ended
    assert chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1
    _stages_empty(text_server, range(1))


def test_the_openai_stream_helper_assembles_every_choice(client, text_server):
    """`client.chat.completions.stream` places a choice by the order the choices' first chunks come
    (index 0 must lead): each choice's role chunk leaves in index order, whichever is ready first."""
    kw = dict(n=3, max_tokens=8, temperature=1.0, seed=11)
    whole = _create(client, **kw)
    for _ in range(3):
        with client.chat.completions.stream(model=MODEL, messages=MESSAGES, **kw) as stream:
            roles = [c.choices[0].index for e in stream if e.type == "chunk" for c in [e.chunk]
                     if c.choices and c.choices[0].delta.role]
            final = stream.current_completion_snapshot  # (get_final_completion refuses a "length" finish)
        assert roles == [0, 1, 2]
        assert [(c.index, c.message.content) for c in final.choices] == \
            [(c.index, c.message.content) for c in whole.choices]
    _stages_empty(text_server, range(1))


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_every_choice(text_server, stream):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True, "n": 3, "stream": stream}
    url = f"{text_server.base_url}/v1/chat/completions"
    if stream:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (kept: a dropped line iterator closes the connection)
            first = next(line for line in lines if line)
            assert '"role":"assistant"' in first, first
            assert len(text_server.stats(0)["request_ids"]) == 3  # all three run
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=1.5)
    _stages_empty(text_server, range(1))
    assert text_server.stats(0)["num_running"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_stages_refuse_is_400_for_every_choice(speech_server, stream):
    """The status waits for every choice's first output: the grammar compiler's refusal is a 400,
    and no choice stays behind in a stage."""
    body = {"model": MODEL, "messages": MESSAGES, "modalities": ["text"], "max_tokens": 8, "n": 2, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}}}
    r = httpx.post(f"{speech_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "schema" in r.json()["error"]["message"], r.text
    _stages_empty(speech_server, range(3))


def test_spoken_choices_each_have_their_audio(speech_server):
    """Audio out: each choice its own audio (own id, transcript, waveform) and its own talker codes
    under it (`choices[i].omni_outputs`); choice 0 is the n = 1 reply of the same seed."""
    client = openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=3,
              modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"})
    two = client.chat.completions.create(n=2, **kw)
    one = client.chat.completions.create(**kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.model_extra["omni_outputs"] is None
    for c in two.choices:
        wave, rate = sf.read(io.BytesIO(base64.b64decode(c.message.audio.data)), dtype="float32")
        assert rate == 24000 and len(wave) > 0 and c.message.content is None
        assert c.message.audio.transcript and c.model_extra["omni_outputs"]["talker"]["token_ids"]
    assert two.choices[0].message.audio.id != two.choices[1].message.audio.id
    assert two.choices[0].message.audio.transcript == one.choices[0].message.audio.transcript
    assert (two.choices[0].model_extra["omni_outputs"]["talker"]["token_ids"]
            == one.model_extra["omni_outputs"]["talker"]["token_ids"])
    assert "omni_outputs" not in one.choices[0].model_extra  # n = 1: on the completion, as before
    _stages_empty(speech_server, range(3))


def test_spoken_choices_stream_each_their_audio(speech_server):
    """A stream of two spoken choices: per index, transcript pieces and audio pieces under one audio
    id that add up to the non-streamed choice; each finish chunk carries its choice's talker codes."""
    client = openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=5, n=2,
              modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16"})
    whole = client.chat.completions.create(**kw)
    transcript, data, audio_ids, codes = defaultdict(str), defaultdict(bytes), defaultdict(set), {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.delta.audio:  # the openai client's ChoiceDeltaAudio
                transcript[c.index] += c.delta.audio.transcript or ""
                data[c.index] += base64.b64decode(c.delta.audio.data or "")
                audio_ids[c.index].add(c.delta.audio.id)
            if c.finish_reason:
                codes[c.index] = chunk.model_extra["omni_outputs"]["talker"]["token_ids"]
    for c in whole.choices:
        assert transcript[c.index] == c.message.audio.transcript
        assert len(audio_ids[c.index]) == 1 and len(data[c.index]) == len(base64.b64decode(c.message.audio.data)) > 0
        assert codes[c.index] == c.model_extra["omni_outputs"]["talker"]["token_ids"]
    assert audio_ids[0] != audio_ids[1]
    _stages_empty(speech_server, range(3))
