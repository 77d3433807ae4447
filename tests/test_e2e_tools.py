"""Tool calling through the openai client against the tiny text server (its config names a chat
template that writes `tools` into the prompt): a named function or `required` decode the calls'
JSON (structured outputs), `auto` leaves the model to write hermes calls (random weights write
none: the reply is text, but the prompt holds the tools), and what is refused."""

from __future__ import annotations

import json

import openai
import pytest

MODEL = "omni-tiny"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Finite arguments (an enum, a boolean): random weights complete the JSON well within max_tokens.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Today's weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=f"{text_server.base_url}/v1", api_key="x", max_retries=0)


def _weather_args(call) -> dict:
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert args["city"] in ("Paris", "Oslo") and isinstance(args["celsius"], bool) and set(args) == {"city", "celsius"}
    return args


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_function_is_called_with_arguments_that_match_its_schema(client, temperature):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=NAMED,
                                          max_tokens=64, temperature=temperature, seed=3)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    _weather_args(call)


def test_required_calls_one_of_the_tools_and_streams_it(client):
    kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
              max_tokens=64, temperature=0)
    [call] = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city", "celsius"} if call.function.name == "get_weather" else {"utc"})
    # Streamed: the openai helper assembles the same call from the deltas.
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == (call.function.name, args)
    assert final.choices[0].finish_reason == "tool_calls"


def test_auto_writes_the_tools_into_the_prompt_and_a_reply_without_calls_is_text(client):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    auto = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=8, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # (the tool's schema is in the prompt)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason in ("stop", "length")
    assert auto.choices[0].message.content


def test_a_conversation_with_a_call_and_its_result_continues(client):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=NAMED,
                                           max_tokens=64, temperature=0)
    [call] = first.choices[0].message.tool_calls
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    assert after.usage.prompt_tokens > first.usage.prompt_tokens + 10 and after.choices[0].message.content


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required"}, None),
    ({"functions": [WEATHER["function"]]}, None),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}, {"role": "tool", "content": "x",
                                                                          "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]}, None),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}, "messages.1"),
])
def test_tool_requests_that_cannot_work_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
    if param:
        assert e.value.body["param"] == param


def test_tools_need_a_template_that_writes_them_and_text_out(speech_server):
    """The default pipeline's template has no tools: a 400, not a reply from a model that never saw
    them; and tool calls are text, so not with speech out."""
    client = openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], modalities=["text"], max_tokens=4)
    assert e.value.body["param"] == "tools" and "writes no tools" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=4)
    assert e.value.body["param"] == "modalities"
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none",
                                          modalities=["text"], max_tokens=4)
    assert resp.choices[0].message.content is not None
