"""OpenAI's Responses API (`POST /v1/responses`, `client.responses.create`), text out.

A response is a chat turn: `instructions` become the system message and `input` (a string, or a list
of messages whose parts are input_text / input_image / input_audio) the rest, so `to_chat` turns the
request into a chat completion body and the chat path runs it (the same template, media limits and
sampling). `ResponseRun` returns the reply as a Response object, or streams OpenAI's typed events
(`response.created` ... `response.output_text.delta` ... `response.completed`). Nothing is stored:
`previous_response_id`, `background` and tools are refused, not ignored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from omni_server.api import errors
from omni_server.api.errors import APIError

# Responses message roles -> chat roles.
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion body (text out) for a Responses request body; APIError 400 for what this
    server does not do."""
    for key, why in (("previous_response_id", "responses are not stored"), ("conversation", "responses are not stored"),
                     ("background", "background responses are not supported"),
                     ("prompt", "stored prompt templates are not supported")):
        if body.get(key):
            raise APIError(400, f"`{key}` is not supported: {why}", param=key)
    if body.get("tools"):
        raise APIError(400, "tools are not supported by /v1/responses here (chat completions take them)",
                       param="tools")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise APIError(400, "`tool_choice` needs tools, which /v1/responses does not take here", param="tool_choice")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise APIError(400, "`include` must be a list of strings", param="include")
    if "message.output_text.logprobs" in (include or []) or body.get("top_logprobs"):
        raise APIError(400, "log-probabilities are not returned by /v1/responses (use chat completions' "
                            "`logprobs`)", param="include")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise APIError(400, "`metadata` must map up to 16 strings (keys up to 64 characters) to strings "
                            "(up to 512)", param="metadata")
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise APIError(400, "`text` must be an object such as {\"format\": {\"type\": \"text\"}}", param="text")
    messages = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise APIError(400, "`instructions` must be a string", param="instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        messages += [_message(item, i) for i, item in enumerate(given)]
    else:
        raise APIError(400, "`input` must be a string or a non-empty list of messages", param="input")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "modalities": ["text"],
                            "stream": body.get("stream", False)}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("seed", "seed"), ("top_k", "top_k"), ("user", "user"), ("ignore_eos", "ignore_eos"),
                         ("repetition_penalty", "repetition_penalty"), ("cache_salt", "cache_salt"), ("stop", "stop")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    fmt = (body.get("text") or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError(400, "`text.format` must be text, json_object or json_schema", param="text.format")
    return chat


# Chat fields -> the Responses fields they came from (for validation errors' locations).
_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def request_errors(errors: list[dict[str, Any]], body: dict[str, Any]) -> list[dict[str, Any]]:
    """Validation errors of the chat body `to_chat` made from `body`, located in `body`: its fields'
    names, and `input`'s indices (the chat's messages start with the instructions, if any)."""
    shift = 0 if body.get("instructions") is None else 1

    def located(loc: tuple) -> tuple:
        if len(loc) > 1 and loc[0] == "messages" and isinstance(loc[1], int):
            return ("input", loc[1] - shift, *loc[2:]) if loc[1] >= shift else ("instructions",)
        if loc[:2] == ("response_format", "json_schema"):  # (the Responses format is flat: text.format.name)
            return ("text.format", *loc[2:])
        return tuple(_FIELDS.get(p, p) if i == 0 else p for i, p in enumerate(loc))
    return [{**e, "loc": located(tuple(e.get("loc", ())))} for e in errors]


def _message(item: Any, i: int) -> dict[str, Any]:
    param = f"input[{i}]"
    role = item.get("role") if isinstance(item, dict) else None
    if not isinstance(item, dict) or item.get("type", "message") != "message" or not isinstance(role, str) \
            or role not in _ROLES:
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        got = f"role {role!r}" if isinstance(role, str) and kind in (None, "message") else repr(kind)
        raise APIError(400, f"{param}: only messages (role user, assistant, system or developer) are supported, "
                            f"got {got}", param=param)
    content = item.get("content")
    if isinstance(content, str):
        return {"role": _ROLES[item["role"]], "content": content}
    if not isinstance(content, list):
        raise APIError(400, f"{param}.content must be a string or a list of parts", param=f"{param}.content")
    return {"role": _ROLES[item["role"]], "content": [_part(p, f"{param}.content[{j}]") for j, p in enumerate(content)]}


def _part(part: Any, param: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    if kind == "input_audio" and isinstance(part.get("input_audio"), dict):
        return {"type": "input_audio", "input_audio": part["input_audio"]}
    if kind in ("input_text", "output_text"):
        raise APIError(400, f"{param}.text must be a string", param=f"{param}.text")
    if kind == "input_image":
        raise APIError(400, f"{param}: an image is given as `image_url` (a data: or http(s) URL); files by id "
                            "are not supported", param=param)
    if kind == "input_file":
        raise APIError(400, f"{param}: file inputs are not supported", param=param)
    raise APIError(400, f"{param}: unsupported part {kind!r} (input_text, input_image, input_audio)", param=param)


class ResponseRun:
    """One response's pipeline request (a chat `Run`), as a Response object or its event stream."""

    def __init__(self, run, body: dict[str, Any], model: str):
        self.run, self.body, self.model = run, body, model
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    async def first(self):
        return await self.run.first()

    async def abort(self) -> None:
        await self.run.abort()

    async def collect(self) -> dict[str, Any]:
        choice = await self.run.collect()
        return self._response(self._status(), [self._item(choice.message.content or "", self._status())])

    def _status(self) -> str:
        return "incomplete" if self.run.finish_reason == "length" else "completed"

    def _item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [_text_part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        done = status != "in_progress"
        usage = None
        if done:
            n_in, n_out = self.run.n_prompt, self.run.completion_tokens
            usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": self.run.n_cached, "cache_write_tokens": 0},
                     "output_tokens": n_out,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}
        text = self.body.get("text") if isinstance(self.body.get("text"), dict) else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if done else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.body.get("instructions"), "max_output_tokens": self.body.get("max_output_tokens"),
            "model": self.model, "output": output, "parallel_tool_calls": False,
            # (the values it sampled with: the request's, else the text stage's configured ones)
            "temperature": self._sampled("temperature", 1.0), "top_p": self._sampled("top_p", 1.0),
            "tool_choice": "none", "tools": [], "text": text or {"format": {"type": "text"}},
            "truncation": "disabled", "metadata": self.body.get("metadata") or {}, "store": False, "usage": usage,
        }

    def _sampled(self, name: str, default: float) -> float:
        given = self.body.get(name)
        if given is not None:
            return given
        state = self.run.state
        configured = getattr(state.cfg.stage(state.sampling_stage).default_sampling, name)
        return default if configured is None else configured

    def _event(self, kind: str, **fields) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    async def events(self, first) -> AsyncIterator[dict[str, Any]]:
        """OpenAI's event sequence for one text message, its deltas as the text comes."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self._event("response.created", response=self._response("in_progress", []))
        yield self._event("response.in_progress", response=self._response("in_progress", []))
        yield self._event("response.output_item.added", output_index=0, item=self._item(None, "in_progress"))
        yield self._event("response.content_part.added", part=_text_part(""), **where)
        texts = []
        try:
            async for _, piece in self.run.stream_from(first):
                texts.append(piece)
                yield self._event("response.output_text.delta", delta=piece, logprobs=[], **where)
        except APIError as e:  # (the status line is gone: OpenAI's error event, then the stream ends)
            body = errors.error_body(e.status, e.message, param=e.param, code=e.code)
            yield self._event("error", message=e.message, code=e.code, param=e.param, **body)
            await self.abort()
            return
        text, status = "".join(texts), self._status()
        yield self._event("response.output_text.done", text=text, logprobs=[], **where)
        yield self._event("response.content_part.done", part=_text_part(text), **where)
        yield self._event("response.output_item.done", output_index=0, item=self._item(text, status))
        yield self._event(f"response.{status}", response=self._response(status, [self._item(text, status)]))


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
