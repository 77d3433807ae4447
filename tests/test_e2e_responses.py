"""OpenAI's Responses API through the real server and the official openai client (tiny thinker, CPU)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests import media, reference
from tests.conftest import MODELS

MODEL = "omni-tiny"
QUESTION = "Tell me about the weather in the city today."


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=f"{text_server.base_url}/v1", api_key="unused", max_retries=0)


def test_response_is_the_chat_reply(client):
    """A response to `input` with `instructions` is the greedy chat reply to the system + user turn,
    as transformers makes it; usage counts the same tokens."""
    resp = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=12,
                                   temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                          messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": QUESTION}],
                                          extra_body={"return_token_ids": True})
    tokens = chat.choices[0].model_extra["token_ids"]
    assert tokens == reference.thinker_greedy(MODELS / "tiny-qwen2_5-omni", chat.model_extra["prompt_token_ids"], 12)
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert (resp.temperature, resp.top_p) == (0.0, 1.0)  # (as sampled: the request's, else the defaults)
    assert [item.type for item in resp.output] == ["message"] and resp.output[0].role == "assistant"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens == len(tokens)
    if len(tokens) == 12:  # cut at max_output_tokens
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None


def test_message_list_input_and_stream(client):
    """`input` as messages (a developer message is a system one; parts as input_text / output_text);
    the stream's deltas make the non-streamed text, in OpenAI's event order."""
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                {"role": "user", "content": QUESTION}]
    kwargs = dict(model=MODEL, input=messages, max_output_tokens=10, temperature=0)
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", f"response.{full.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == full.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens
    chat = client.chat.completions.create(model=MODEL, max_tokens=10, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": QUESTION}])
    assert full.output_text == chat.choices[0].message.content


def test_image_and_audio_parts_are_the_chats(client):
    """input_image (a data URL) and input_audio parts reach the thinker as the chat's image_url and
    input_audio parts do: the same greedy reply."""
    url, _ = media.png(56, 56)
    wav, _ = media.tone_wav(1.0)
    ours = [{"type": "input_text", "text": "What is in this?"}, {"type": "input_image", "image_url": url},
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]
    chats = [{"type": "text", "text": "What is in this?"}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]
    resp = client.responses.create(model=MODEL, input=[{"role": "user", "content": ours}], max_output_tokens=8,
                                   temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chats}], max_tokens=8,
                                          temperature=0)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens > 50  # (the image's and audio's tokens counted)


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = client.responses.create(model=MODEL, input="Answer in JSON.", max_output_tokens=40, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    import json

    if resp.status == "completed":
        assert isinstance(json.loads(resp.output_text)["ok"], bool)
    else:  # cut at max_output_tokens: still a prefix the grammar allows
        assert resp.output_text.startswith("{")


@pytest.mark.parametrize("extra, needle", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "not stored"),
    ({"background": True}, "background"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "function_call_output"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "file inputs"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "files by id"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, r"- text\.format\.name: Field required"),
    ({"max_output_tokens": 0}, "max_output_tokens: Input should be greater than or equal to 1"),
    ({"instructions": "x", "input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     r"input\.0\.content"),  # (located in `input`, past the instructions' system message)
    ({"input": [{"role": ["user"], "content": "x"}]}, "only messages"),
    ({"metadata": {"a": 1}}, "metadata"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"include": ["message.output_text.logprobs"]}, "log-probabilities"),
    ({"include": 5}, "`include` must be a list of strings"),
    ({"include": True, "stream": True}, "`include` must be a list of strings"),
    ({"text": "json"}, "`text` must be an object"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}],
      "model": MODEL}, "image data could not be decoded"),  # (the chat path's media checks)
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, r"input\[0\]\.content\[0\]\.text must be a string"),
    ({"input": [{"role": "tool", "content": "x"}]}, "got role 'tool'"),
])
def test_unsupported_requests_are_400(client, extra, needle):
    kwargs = {"model": MODEL, "input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError, match=needle) as e:
        client.responses.create(**kwargs)
    assert e.value.body["param"] != "messages"  # (a Responses body has none: its errors name its own fields)


def test_payloads_validate_against_the_sdk_types(text_server):
    """The raw JSON, checked strictly with the openai SDK's models (the client itself builds its
    objects without validating them): the response, and every event of a stream."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    url = f"{text_server.base_url}/v1/responses"
    body = {"model": MODEL, "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 4,
            "metadata": {"k": "v"}, "text": {"format": {"type": "text"}}}
    r = httpx.post(url, json=body)
    assert r.status_code == 200
    resp = Response.model_validate(r.json(), strict=True)
    assert resp.metadata == {"k": "v"} and resp.instructions == "Be brief."
    events = TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", url, json={**body, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        raw = [line for line in s.iter_lines() if line]
    lines = [line[6:] for line in raw if line.startswith("data: ")]
    parsed = [events.validate_json(line, strict=True) for line in lines]
    # Each event as OpenAI sends it: an `event:` line naming its type, then its data.
    assert raw == [x for e, line in zip(parsed, lines) for x in (f"event: {e.type}", f"data: {line}")]
    assert parsed[-1].type in ("response.completed", "response.incomplete")
    Response.model_validate(parsed[-1].response.model_dump(), strict=True)


@pytest.mark.parametrize("body", [
    {"input": [{"role": "user", "content": [1, None, "x"]}]}, {"input": [{"role": "user", "content": 5}]},
    {"input": [["user", "hi"]]}, {"input": 7}, {"input": {"role": "user"}}, {"instructions": 3, "input": "x"},
    {"input": "x", "text": {"format": "json"}}, {"input": "x", "temperature": "hot"}, {"input": "x", "stream": []},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": "wav"}]}]},
])
def test_malformed_bodies_are_400(text_server, body):
    r = httpx.post(f"{text_server.base_url}/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_errors_and_streams_without_the_client(text_server):
    url = f"{text_server.base_url}/v1/responses"
    r = httpx.post(url, json={"model": "nope", "input": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(url, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    with httpx.stream("POST", url, json={"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert '"response.completed"' in lines[-1] or '"response.incomplete"' in lines[-1]


def test_usage_reports_the_prefix_cache(client):
    """The same long input twice: the second response's input starts on the prefix cache."""
    text = "Describe the harbour at dawn, the boats, the nets and the birds. " * 20
    client.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0)
    again = client.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0)
    assert again.usage.input_tokens > 128
    assert 128 <= again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens
    # Under a salt the same input is computed again (and then shared with that salt only).
    salted = [client.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0,
                                      extra_body={"cache_salt": "tenant-1"}) for _ in range(2)]
    assert [r.usage.input_tokens_details.cached_tokens >= 128 for r in salted] == [False, True]


def test_stop_extension_ends_the_text_as_chat_does(client):
    """`stop` (an extension, through extra_body): the text ends before the stop string, as the chat's
    does, and the response is completed, not incomplete."""
    kwargs = dict(model=MODEL, max_tokens=16, temperature=0, messages=[{"role": "user", "content": QUESTION}])
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    assert len(stop) == 3 and whole.index(stop) > 0
    resp = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0,
                                   extra_body={"stop": [stop]})
    chat = client.chat.completions.create(**kwargs, stop=[stop])
    assert resp.output_text == chat.choices[0].message.content == whole[:whole.index(stop)]
    assert resp.status == "completed" and resp.incomplete_details is None
