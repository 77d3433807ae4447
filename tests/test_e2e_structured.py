"""`response_format` (JSON object / JSON Schema) through the embedded default pipeline and the official
openai client: the thinker only samples tokens the grammar allows, so even random weights answer in
valid JSON that matches the schema."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "omni-tiny"
MESSAGES = [{"role": "user", "content": "Is it raining in the city today?"}]
ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(speech_server):
    return openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0)


def _matches(text: str) -> bool:
    doc = json.loads(text)
    return set(doc) == {"answer", "sure"} and doc["answer"] in ("yes", "no") and isinstance(doc["sure"], bool)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answer_matches_the_schema(client, temperature):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"], max_tokens=64,
                                          temperature=temperature, seed=5, response_format=ANSWER)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert _matches(choice.message.content), choice.message.content


def test_unconstrained_answer_is_not_json(client):
    """The check above means something: without response_format the same request is not JSON."""
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"], max_tokens=16,
                                          temperature=0)
    with pytest.raises(ValueError):
        json.loads(resp.choices[0].message.content)


def test_streamed_json_schema_answer_matches_the_schema(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"], max_tokens=64,
                                            temperature=0, response_format=ANSWER, stream=True)
    parts, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop"
    assert _matches("".join(parts)), parts


def test_json_schema_answer_with_speech(client):
    """With audio out the text comes as the audio's transcript (content is null, as OpenAI's): the
    JSON the thinker wrote under the grammar, then spoken."""
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                          modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"},
                                          response_format=ANSWER)
    msg = resp.choices[0].message
    assert msg.content is None and _matches(msg.audio.transcript), msg.audio.transcript
    assert len(msg.audio.data) > 1000


def test_json_object_answer_starts_an_object(client):
    """Any JSON object: random weights may not close it within max_tokens, but it must start as one
    and hold no free whitespace (configs/default.yaml: disable_any_whitespace)."""
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"], max_tokens=24,
                                          temperature=0, response_format={"type": "json_object"})
    text = resp.choices[0].message.content
    assert text.startswith("{"), text
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_text_format_is_unconstrained(client):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"], max_tokens=16,
                                           temperature=0)
    text = client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"], max_tokens=16,
                                          temperature=0, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("fmt,says", [
    ({"type": "json_schema"}, "needs a json_schema"),
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "", "schema": {}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}, "schema"),
    # (refused by xgrammar in the stage: its message without the library's source path)
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}, "Cannot find field 'nope'"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_response_format_is_400(speech_server, fmt, says, stream):
    body = {"model": MODEL, "messages": MESSAGES, "modalities": ["text"], "max_tokens": 8, "stream": stream,
            "response_format": fmt}
    r = httpx.post(f"{speech_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says in err["message"] and "Traceback" not in err["message"] and ".cc:" not in err["message"], err


def test_server_still_answers_after_a_bad_schema(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, modalities=["text"], max_tokens=8,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "no-such-type"}}})
    test_json_schema_answer_matches_the_schema(client, 0.0)
