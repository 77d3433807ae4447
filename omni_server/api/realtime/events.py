"""A Realtime client event's fields checked: the errors said back (`EventError`: an `error` event, the
session goes on), the fields each event and part may have, and the settings' values."""

from __future__ import annotations

import uuid
from typing import Any

MIN_COMMIT_S = 0.1  # (OpenAI's least committed audio)
# OpenAI's server_vad defaults (a session starts with it on, as theirs do)
VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
       "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}


class EventError(Exception):
    """A client event this session cannot take: an `error` event, the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


# A client event's fields by its type
EVENT_FIELDS = {kind: {"type", "event_id"} | more for kind, more in {
    "session.update": {"session"}, "input_audio_buffer.append": {"audio"}, "input_audio_buffer.clear": set(),
    "input_audio_buffer.commit": set(), "conversation.item.create": {"previous_item_id", "item"},
    "conversation.item.delete": {"item_id"}, "conversation.item.retrieve": {"item_id"},
    "conversation.item.truncate": {"item_id", "content_index", "audio_end_ms"}, "response.create": {"response"},
    "response.cancel": {"response_id"}}.items()}
TRANSCRIPTION_FIELDS = {"type", "audio", "include"}
# An item's part's fields by its type (an assistant's output_audio may carry its audio: the
# conversation reads such a turn by its transcript)
PART_FIELDS = {"input_text": {"type", "text"}, "text": {"type", "text"}, "output_text": {"type", "text"},
               "input_audio": {"type", "audio", "transcript"}, "input_image": {"type", "image_url", "detail"},
               "output_audio": {"type", "transcript", "audio"}}
SESSION_FIELDS = {"type", "model", "instructions", "output_modalities", "max_output_tokens", "temperature", "audio",
                  "tools", "tool_choice", "truncation", "include", "tracing", "prompt"}
RESPONSE_FIELDS = {"conversation", "input", "instructions", "output_modalities", "max_output_tokens", "temperature",
                   "audio", "tools", "tool_choice", "metadata", "prompt"}


def only(given: Any, known: set[str], where: str) -> None:
    """Fields this server does not know are an error, not ignored (a setting that would do nothing)."""
    unknown = sorted(set(given) - known) if isinstance(given, dict) else []
    if unknown:  # (`where` "": the event's own fields)
        raise EventError(f"unknown field(s) in `{where or given.get('type')}`: {', '.join(unknown)}",
                         code="unknown_parameter", param=f"{where}.{unknown[0]}" if where else unknown[0])


def transcript_of(item: dict[str, Any]) -> str | None:
    return next((p.get("transcript") for p in item["content"] if p["type"] == "input_audio"), None)


# semantic_vad (OpenAI's Agents SDK asks for it by default) without a turn model: the same level gate,
# ending a turn after a silence `eagerness` sets (its other settings server_vad's defaults)
SEMANTIC_VAD = {"type": "semantic_vad", "eagerness": "auto", "create_response": True, "interrupt_response": True}
EAGERNESS_SILENCE_MS = {"high": 500, "medium": 800, "auto": 800, "low": 1500}


def gate(vad: dict[str, Any]) -> dict[str, Any]:
    """The level gate's settings for a session's turn detection (server_vad's own; semantic_vad's
    from its eagerness)."""
    if vad["type"] == "server_vad":
        return vad
    return {**VAD, "create_response": vad["create_response"], "interrupt_response": vad["interrupt_response"],
            "silence_duration_ms": EAGERNESS_SILENCE_MS[vad["eagerness"]]}


def turn_detection(value: Any, kind: str = "realtime") -> dict[str, Any] | None:
    """A session's `turn_detection`: null (the client ends turns), server_vad (the turns module's
    level gate) or semantic_vad (the same gate, its silence from `eagerness`; no turn model). In a
    transcription session it makes no responses: `create_response`, `interrupt_response` false and
    no `idle_timeout_ms`."""
    param = "session.audio.input.turn_detection"
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("server_vad", "semantic_vad"):
        raise EventError("`turn_detection` must be null, {\"type\": \"server_vad\", ...} or {\"type\": "
                         "\"semantic_vad\", ...}", param=f"{param}.type")
    defaults = VAD if value["type"] == "server_vad" else SEMANTIC_VAD
    unknown = set(value) - set(defaults)
    if unknown:
        raise EventError(f"unknown {value['type']} field(s): {', '.join(sorted(unknown))}", param=param)
    quiet = {"create_response": False, "interrupt_response": False} if kind == "transcription" else {}
    vad = {**defaults, **quiet, **{k: v for k, v in value.items() if v is not None}}
    for key in quiet:
        if vad[key] is not False:
            raise EventError(f"a transcription session makes no responses: `{key}` is false", param=f"{param}.{key}")
    for key in ("create_response", "interrupt_response"):
        if not isinstance(vad[key], bool):
            raise EventError(f"`{key}` must be true or false", param=f"{param}.{key}")
    if vad["type"] == "semantic_vad":
        if not isinstance(vad["eagerness"], str) or vad["eagerness"] not in EAGERNESS_SILENCE_MS:
            raise EventError("`eagerness` must be low, medium, high or auto", param=f"{param}.eagerness")
        return vad
    if kind == "transcription" and vad["idle_timeout_ms"] is not None:
        raise EventError("a transcription session makes no responses: no `idle_timeout_ms`",
                         param=f"{param}.idle_timeout_ms")

    def number(key: str, low: float, high: float, whole: bool) -> None:
        v = vad[key]
        if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) or not low <= v <= high:
            raise EventError(f"`{key}` must be {'an integer' if whole else 'a number'} from {low:g} to {high:g}",
                             param=f"{param}.{key}")
    number("threshold", 0, 1, whole=False)
    number("prefix_padding_ms", 0, 5000, whole=True)
    number("silence_duration_ms", 20, 10000, whole=True)
    if vad["idle_timeout_ms"] is not None:
        number("idle_timeout_ms", 100, 600000, whole=True)
    return vad


LOGPROBS = "item.input_audio_transcription.logprobs"
_FORMATS = {"audio/pcm": ({"rate"}, 24000), "audio/pcmu": (set(), None), "audio/pcma": (set(), None)}


def audio_format(value: Any, param: str) -> str:
    """An audio format object: {"type": "audio/pcm", "rate": 24000} (PCM16, mono), or the telephone
    formats {"type": "audio/pcmu"} / {"type": "audio/pcma"} (G.711 mu-law / A-law, 8 kHz)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in _FORMATS:
        raise EventError('an audio format is {"type": "audio/pcm", "rate": 24000}, {"type": "audio/pcmu"} or '
                         '{"type": "audio/pcma"}', param=param)
    fields, rate = _FORMATS[kind]
    only(value, {"type"} | fields, param)
    if value.get("rate", rate) != rate:
        raise EventError(f"{kind} is served at {rate} Hz", param=f"{param}.rate")
    return kind


def include(value: Any) -> list[str] | None:
    if value is None or value == []:
        return None
    if value == [LOGPROBS]:
        return [LOGPROBS]
    raise EventError(f'`include` is null or ["{LOGPROBS}"] (input transcription with its tokens\' log-probabilities)',
                     param="session.include")


def speed(value: Any, param: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.25 <= value <= 1.5:
        return float(value)
    raise EventError("`speed` must be a number from 0.25 to 1.5 (1: as generated)", param=param)


def max_tokens(value: Any, param: str) -> int | str:
    if value == "inf" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096):
        return value
    raise EventError('`max_output_tokens` must be 1 to 4096 or "inf"', param=param)


def temperature(value: Any, param: str) -> float | None:
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 2):
        return value
    raise EventError("`temperature` must be a number from 0 to 2 (0: greedy)", param=param)
