"""Tool calls (omni_server/api/tools.py): read out of the reply's text, whole or as it streams, and
the JSON a `tool_choice` asks the text stage for; through the chat route with a stand-in pipeline."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from omni_server.api.tools import Calls, choice_schema

REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n')


def _plain(items):
    """Content joined per run, calls as (name, arguments)."""
    out = []
    for kind, value in items:
        if kind == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + value)
        else:
            out.append((kind, value if kind == "content" else (value["function"]["name"], value["function"]["arguments"])))
    return out


def test_hermes_calls_are_read_out_of_the_text():
    content, calls = Calls.split("auto", REPLY)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("seed", range(20))
def test_streamed_in_any_pieces_the_calls_come_as_whole(seed):
    rng, calls, items, i = random.Random(seed), Calls("auto"), [], 0
    while i < len(REPLY):
        k = rng.randint(1, 9)
        items += calls.feed(REPLY[i:i + k])
        i += k
    items += calls.close()
    assert _plain(items) == [("content", "Let me look.\n"), ("call", ("get_weather", '{"city": "Paris"}')),
                             ("call", ("get_time", "{}"))]
    assert calls.count == 2


@pytest.mark.parametrize("text", ["a <tool_call>not json</tool_call> b", "a <tool_call>{\"arguments\": {}}</tool_call>",
                                  "cut <tool_call>{\"name\": \"f\", \"argu", "x < y, <tool_ and <tool_cal"])
def test_text_that_is_no_call_stays_content(text):
    assert Calls.split("auto", text) == (text, [])
    calls = Calls("auto")
    assert "".join(v for _, v in calls.feed(text) + calls.close()) == text and calls.count == 0


def test_a_named_function_or_required_calls_are_the_whole_reply():
    assert _plain(Calls("named", "f").feed('{"a": 1}')) == []
    content, [call] = Calls.split("named", '{"a": 1}', name="f")
    assert content is None and call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    content, calls = Calls.split("required", '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert Calls.split("required", '[{"name": "f", "argu') == ('[{"name": "f", "argu', [])  # (cut by max_tokens)
    # A named call cut short (max_tokens, a stop string) is no call either: its text, and the
    # finish reason stays the stage's ("length" / "stop"), not "tool_calls".
    assert Calls.split("named", '{"c', name="f") == ('{"c', [])
    calls = Calls("named", "f")
    assert calls.feed('{"') == [] and calls.close() == [("content", '{"')] and calls.count == 0


def test_json_nested_past_the_recursion_limit_is_no_call_and_no_500():
    deep = "[" * 5000 + "]" * 5000
    from omni_server.api.media import _json_or_text

    assert _json_or_text(deep) == deep  # (an earlier turn's tool-call arguments: read as text)
    assert Calls.split("auto", f"<tool_call>{{\"name\": \"f\", \"arguments\": {deep}}}</tool_call>")[1] == []
    assert Calls.split("required", deep) == (deep, [])
    assert Calls.split("named", deep, name="f") == (deep, [])


def test_tool_choice_asks_for_the_calls_json():
    tools = [{"function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
             {"function": {"name": "g"}}]
    assert choice_schema(tools, "auto", True) is None and choice_schema(tools, "none", True) is None
    assert choice_schema(tools, {"type": "function", "function": {"name": "f"}}, True) == tools[0]["function"]["parameters"]
    required = choice_schema(tools, "required", False)
    assert required["type"] == "array" and required["minItems"] == 1 and required["maxItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["f"], ["g"]]
    assert required["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object"}


# ---- through the chat route's Run, the text stage stood in for -----------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _reply(tiny_models, tmp_path, stream: bool, **body):
    """The chat reply (or its stream's chunks) when the text stage writes REPLY token by token."""
    from tests.test_api_unit import _bounded, _completion, _Deltas
    from omni_server.api.text import TextCodec
    from omni_server.wire.messages import RequestDelta
    from tests.conftest import MODELS

    ids = TextCodec(str(MODELS / "tiny-qwen2_5-omni")).encode(REPLY)

    async def main():
        orch = _Deltas()
        completion = _completion(tmp_path, 1, orch, stream=stream, tools=[WEATHER], **body)
        for k, token in enumerate(ids):
            orch.queues["c-0"].put_nowait(RequestDelta("c-0", new_token_ids=[token], finished=k == len(ids) - 1,
                                                       finish_reason="stop" if k == len(ids) - 1 else None))
        if not stream:
            return (await completion.collect()).model_dump()
        return [json.loads(e[6:]) async for e in completion.sse(await completion.first()) if e != "data: [DONE]\n\n"]

    return _bounded(main)


def test_a_reply_with_calls_has_tool_calls_and_finishes_for_them(tiny_models, tmp_path):
    reply = _reply(tiny_models, tmp_path, stream=False)
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_a_streamed_reply_sends_each_call_whole_with_its_index(tiny_models, tmp_path):
    chunks = _reply(tiny_models, tmp_path, stream=True)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d["delta"].get("tool_calls") or []]
    assert content == "Let me look.\n"
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}'), (1, "get_time", "{}")]
    assert deltas[-1]["finish_reason"] == "tool_calls" and all(d["finish_reason"] is None for d in deltas[:-1])
    assert "<tool_call>" not in content


def test_tool_choice_none_leaves_the_text_as_it_is(tiny_models, tmp_path):
    [choice] = _reply(tiny_models, tmp_path, stream=False, tool_choice="none")["choices"]
    assert choice["message"]["content"] == REPLY and choice["message"]["tool_calls"] is None
    assert choice["finish_reason"] == "stop"
