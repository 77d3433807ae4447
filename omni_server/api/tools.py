"""Tool calls in chat replies: what the text stage is asked for, and the calls read out of its text.

`tool_choice: auto` lets the model write calls in the "hermes" form the Qwen family's templates ask
for (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them);
`required` and a named function constrain the text stage's decoding to JSON instead (vLLM's
structured outputs): an array of calls, or the named function's arguments. `Calls` turns the text
into OpenAI's `tool_calls`, whole or as it streams.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def choice_schema(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema the reply must match for `tool_choice` (None for auto / none): a named
    function's arguments, or for `required` an array of one or more calls of the tools given."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if isinstance(choice, dict):
        return params[choice["function"]["name"]]
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "arguments": schema},
              "required": ["name", "arguments"]} for name, schema in params.items()]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _hermes(body: str) -> dict[str, Any] | None:
    """One `<tool_call>` body as a call, or None if it is not a JSON object with a string name."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # (JSON nested past Python's recursion limit)
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


class Calls:
    """One reply's text split into content and tool calls. `feed` takes the text as it streams and
    returns what can go out now: ("content", text) and ("call", call) items, in order; a piece that
    may be the start of a `<tool_call>` waits for the text after it. `close` returns the rest.
    `mode`: "auto" (hermes calls within the text), "named" (the text is the arguments of
    `name`), "required" (the text is a JSON array of {name, arguments})."""

    def __init__(self, mode: str, name: str | None = None):
        self.mode, self.name = mode, name
        self.held = ""  # text not yet given out
        self.count = 0  # calls given out

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.held += text
        if self.mode != "auto":
            return []  # (the JSON is read whole, at the end)
        out: list[tuple[str, Any]] = []
        while self.held:
            start = self.held.find(OPEN)
            if start < 0:  # no call opens: all but a possible start of one goes out
                keep = _partial_suffix(self.held, OPEN)
                self._content(out, self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
            self._content(out, self.held[:start])
            self.held = self.held[start:]
            end = self.held.find(CLOSE)
            if end < 0:
                break  # the call is still being written
            body, self.held = self.held[len(OPEN):end], self.held[end + len(CLOSE):]
            call = _hermes(body)
            if call is None:  # not a call after all: the text as it was
                self._content(out, OPEN + body + CLOSE)
            else:
                self.count += 1
                out.append(("call", call))
        return out

    def close(self) -> list[tuple[str, Any]]:
        held, self.held = self.held, ""
        if self.mode == "named":
            try:
                whole = isinstance(json.loads(held), dict)
            except (ValueError, RecursionError):
                whole = False
            if not whole:  # (cut short by max_tokens or a stop string: no call, as with "required")
                return [("content", held)] if held else []
            self.count += 1
            return [("call", _call(self.name, held))]
        if self.mode == "required":
            try:
                calls = [_call(c["name"], c.get("arguments", {})) for c in json.loads(held)]
            except (ValueError, RecursionError, TypeError, KeyError):
                return [("content", held)] if held else []  # (cut short by max_tokens: not JSON yet)
            self.count += len(calls)
            return [("call", c) for c in calls]
        out: list[tuple[str, Any]] = []
        self._content(out, held)  # (an unclosed call: the text as it was)
        return out

    def _content(self, out: list, text: str) -> None:
        if text and (text.strip() or not self.count):  # (not the whitespace between and after calls)
            out.append(("content", text))

    @staticmethod
    def split(mode: str, text: str, name: str | None = None) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole reply's content (None when only calls) and calls."""
        calls = Calls(mode, name)
        items = calls.feed(text) + calls.close()
        content = "".join(v for k, v in items if k == "content")
        found = [v for k, v in items if k == "call"]
        return (content.strip() or None) if found else content, found


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
