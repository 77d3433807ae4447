"""The HTTP API contract (pydantic): request and response bodies, as OpenAI defines them."""

from __future__ import annotations

import functools
import json
import re
import time
import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic_core import PydanticCustomError
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, ValidationInfo, field_validator, model_serializer,
                      model_validator)


class _Lenient(BaseModel):
    # Unknown fields from newer OpenAI clients are ignored rather than rejected.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """null for a field that has a default but takes no null (`n`, `stream`, `echo`) means the
        default, as OpenAI reads it (the openai client's types declare them Optional)."""
        if isinstance(data, dict) and None in data.values():
            fields = _defaulted_not_null(cls)
            data = {k: v for k, v in data.items() if not (v is None and k in fields)}
        return data


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(data: Any) -> str | None:
    """Where decoded JSON holds a lone UTF-16 surrogate (JSON's `"\\ud83d"` decodes to one; it is no
    Unicode text, so the tokenizer and the UTF-8 encoder of any reply echoing it raise): the dotted
    path of the first such string or key, None when there is none. One walk, mostly `isascii`."""
    bad = lambda s: not s.isascii() and _SURROGATE.search(s) is not None  # noqa: E731
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if bad(v):
                return ".".join(map(str, path)) or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and bad(k):
                    return f"{'.'.join(map(str, path)) or 'body'} (a key)"
                if isinstance(x, (str, dict, list)):
                    stack.append(((*path, k), x))
        elif isinstance(v, list):
            stack.extend(((*path, i), x) for i, x in enumerate(v) if isinstance(x, (str, dict, list)))
    return None


class _Body(_Lenient):
    """A request body: text in it must be Unicode (a 400 naming where, not a 500 further on)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        where = lone_surrogate(data)
        if where is not None:
            # (ctx `param`: the parameter the api's error names, for an error of the whole body)
            raise PydanticCustomError("not_unicode", not_unicode(where).replace("{", "{{").replace("}", "}}"),
                                      {"param": where})
        return data


def not_unicode(where: str) -> str:
    return f"{where}: holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), which is not Unicode text"


@functools.cache
def _defaulted_not_null(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, f in model.model_fields.items()
                     if not f.is_required() and not _takes_none(f.annotation))


def _takes_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    if typing.get_origin(annotation) is Annotated:
        return _takes_none(typing.get_args(annotation)[0])
    return any(_takes_none(a) for a in typing.get_args(annotation)) if typing.get_origin(annotation) in (
        Union, types.UnionType) else False


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class InputAudio(_Lenient):
    data: str  # base64
    # OpenAI's wav / mp3, and flac / ogg; the bytes are sniffed either way (a mislabeled file decodes)
    format: Literal["wav", "mp3", "flac", "ogg"] | None = None


class InputAudioPart(_Lenient):
    type: Literal["input_audio"]
    input_audio: InputAudio


class ImageURL(_Lenient):
    url: str  # data:image/...;base64,..., or http(s) where server.media_url_domains allows
    detail: str | None = None


class ImageURLPart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Lenient):
    url: str  # data:video/...;base64,..., or http(s) where server.media_url_domains allows


class VideoURLPart(_Lenient):
    """vLLM's extension of OpenAI's content parts for video input."""

    type: Literal["video_url"]
    video_url: VideoURL


class AudioURL(_Lenient):
    url: str  # data:audio/...;base64,..., or http(s) where server.media_url_domains allows


class AudioURLPart(_Lenient):
    """vLLM's extension of OpenAI's content parts: audio by URL (OpenAI's own is `input_audio`)."""

    type: Literal["audio_url"]
    audio_url: AudioURL


MediaPart = InputAudioPart | AudioURLPart | ImageURLPart | VideoURLPart
ContentPart = Annotated[Union[TextPart, InputAudioPart, AudioURLPart, ImageURLPart, VideoURLPart],
                        Field(discriminator="type")]


class FunctionCall(_Lenient):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(BaseModel):
    """A streamed call: the whole call in one piece (its index counts the choice's calls)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# Each message and part is validated, then rendered by the chat template on the api's event loop:
# 255k one-part messages (a 16 MB body) held it ~10 s before the prompt-length check refused them.
MAX_MESSAGES, MAX_PARTS = 4096, 1024
# Parts and tool calls of all messages together, counted before any is validated: within the caps
# above, 640k empty parts (or 500k calls) in a 16 MB body held the event loop ~4 s to validate.
MAX_ITEMS = 8192

# A JSON schema becomes a grammar in the text stage's engine loop (xgrammar), where its cost grows
# steeply with nesting: 350 levels of 40 properties held that loop 106 s (every request stalled,
# the stage was killed as hung). Real schemas stay far inside these bounds (64 JSON levels are 32
# nested objects, each a "properties" mapping deeper: 32 objects of 60 properties took 0.13 s).
MAX_SCHEMA_DEPTH, MAX_SCHEMA_BYTES = 64, 64 * 1024
# A `pattern`'s counted repeats ({m,n}) unroll in the grammar: its build time grows with their
# square (`[a-z]{1,50000}`, a 178-byte request, held the text stage's loop past stage_timeout_s:
# killed as hung, every request on it failed; {1,4000} took ~1 s on an 8k vocabulary). This bounds
# the positions the schema's patterns unroll to, all together (a nested repeat multiplies).
MAX_PATTERN_REPEATS = 1024


def _bounded_schema(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is None:
        return v
    if len(json.dumps(v)) > MAX_SCHEMA_BYTES:
        raise ValueError(f"the JSON schema is over {MAX_SCHEMA_BYTES // 1024} KiB")
    level, depth, repeats = [v], 0, 0
    while level:  # (breadth-first: no recursion limit to hit)
        depth += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        for x in level:
            if isinstance(x, dict):
                keyed = x.get("patternProperties")
                patterns = ([x["pattern"]] if isinstance(x.get("pattern"), str) else []) + (
                    [k for k in keyed if isinstance(k, str)] if isinstance(keyed, dict) else [])
                repeats += sum(_unrolled(p) for p in patterns)
        if repeats > MAX_PATTERN_REPEATS:
            raise ValueError(f"the JSON schema's patterns repeat to over {MAX_PATTERN_REPEATS} positions in all "
                             "(counted repeats such as {1,5000}): bound lengths with minLength / maxLength instead")
        level = [c for x in level for c in (x.values() if isinstance(x, dict) else x) if isinstance(c, (dict, list))]
    return v


_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _unrolled(pattern: str) -> int:
    """About how many positions a regex unrolls to: an atom counts 1, times its counted repeat's
    bound ({m,n}: n, {m,}: m; *, +, ? count once), a group the sum inside times its own repeat."""
    stack, i = [0], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "(":
            stack.append(0)
            i += 1
            continue
        if c == ")" and len(stack) > 1:
            unit, i = max(stack.pop(), 1), i + 1
        elif c == "[":  # a class is one atom: up to its closing bracket (a first ] or an escaped one is inside)
            j = i + 2 if pattern[i + 1:i + 2] in ("]", "^") else i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            unit, i = 1, j + 1
        else:
            unit, i = 1, i + (2 if c == "\\" else 1)
        m = _QUANTIFIER.match(pattern, i)
        if m:
            low, high = int(m.group(1)), m.group(2)
            unit *= max(low, int(high) if high else 0)
            i = m.end()
        stack[-1] += unit
    while len(stack) > 1:  # (unbalanced: the regex compiler refuses it later; count what is there)
        stack[-2] += stack.pop()
    return stack[0]


JSONSchema = Annotated[dict[str, Any], AfterValidator(_bounded_schema)]


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: JSONSchema | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None
    name: str | None = None
    # OpenAI's reference to an earlier spoken reply ({"id": ...}): refused, not dropped unread.
    audio: Any = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # (an assistant's: calls it made)
    tool_call_id: str | None = None  # (a tool's: the call it answers)

    @model_validator(mode="after")
    def _no_audio_reference(self) -> ChatMessage:
        if self.audio is not None:
            raise ValueError("a message's `audio` (an earlier reply's audio by id) is not supported: this server "
                             "stores no replies; send that reply's transcript as the message's `content`")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has `tool_calls`")
        if self.role == "tool" and not self.tool_call_id:  # (OpenAI's rule: the template pairs result and call by it)
            raise ValueError("a tool message needs `tool_call_id`: the id of the call it answers")
        if (self.content is None or self.content == []) and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs `content` (a string or a non-empty list of parts)"
                             + (" or `tool_calls`" if self.role == "assistant" else ""))
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def media_parts(self) -> list[MediaPart]:
        if not isinstance(self.content, list):
            return []
        return [p for p in self.content if not isinstance(p, TextPart)]


class AudioOutputParam(_Lenient):
    """`audio` of a chat request: the voice and encoding of the spoken reply."""

    voice: str | None = None
    format: str = "wav"


class JSONSchemaFormat(_Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` shadows a pydantic BaseModel attribute, hence the alias.
    json_schema: JSONSchema = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """`response_format` of a chat request: free text, any JSON object, or JSON matching a schema
    (enforced while decoding: the text stage only samples tokens the grammar allows)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({name, schema})")
        return self


# A request's `seed`: int64, as vLLM's server takes it (a larger one would fail in the stages: a 500).
Seed = Annotated[int | None, Field(ge=-(2**63), le=2**63 - 1)]
# Prefix-cache salt (vLLM's extension): only requests with the same salt reuse each other's cached prefixes.
CacheSalt = Annotated[str | None, Field(min_length=1, max_length=256)]


class MMProcessorKwargs(BaseModel):
    """vLLM's per-request `mm_processor_kwargs`, limited to what a client may choose here (the rest
    of the processor's arguments the server sets)."""
    model_config = ConfigDict(extra="forbid")
    # Hear each video's audio track with its frames (Qwen Omni's `use_audio_in_video`): the tracks
    # are the request's audio, so it may have no audio parts of its own.
    use_audio_in_video: StrictBool = False


# The most choices (`n`) one chat request may ask for.
MAX_CHOICES = 8
# The most prompts one completion request may batch.
MAX_PROMPTS = 64


class StreamOptions(_Lenient):
    include_usage: bool = False


def stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
    """OpenAI's rule: `stream_options` only with `stream: true` (else a 400, not silently ignored).
    (A field validator: `stream` comes first in the models, so it is known here.)"""
    if v is not None and not info.data.get("stream"):
        raise ValueError("only allowed when stream is true")
    return v


class ChatCompletionRequest(_Body):
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # (larger did not fit the wire: a 500)
    # Choice i draws from seed + i, which the stages take up to 2**64 - 1.
    seed: Seed = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    # Choices: independent samples of the prompt, each its own pipeline request (hence a cap).
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    user: str | None = None
    # Log-probabilities of the text's tokens (the model's, before temperature and penalties), with
    # up to 20 alternatives per token.
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Output kinds; None = every output the pipeline has (text and audio for a speech pipeline).
    modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1)
    audio: AudioOutputParam | None = None
    response_format: ResponseFormat | None = None
    # Token id (as a string, OpenAI's form) -> bias added to its logit, -100..100 (-100: never).
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    # Tools the model may call (api/tools.py); the deprecated `functions` form is refused.
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None
    # Extensions (vLLM-compatible names), passed by the openai client through `extra_body`.
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_salt: CacheSalt = None
    mm_processor_kwargs: MMProcessorKwargs | None = None

    _stream_options = field_validator("stream_options")(classmethod(stream_options_need_stream))
    # What the client called its reply's token limit (/v1/responses: max_output_tokens), for errors.
    _max_tokens_name: str = PrivateAttr("max_tokens")

    def audio_in_video(self) -> bool:
        return self.mm_processor_kwargs is not None and self.mm_processor_kwargs.use_audio_in_video

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else self._max_tokens_name

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return logit_bias(v)

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, v: Any) -> Any:
        if v:
            raise ValueError("the deprecated `functions` / `function_call` are not supported: use `tools` / `tool_choice`")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, v: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if v not in (None, "none") and not names:
            raise ValueError("only allowed when tools are given")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"names the function {v.function.name!r}, which `tools` does not have")
        return v

    def tool_mode(self) -> str | None:
        """How the reply holds tool calls (api/tools.py): None (no tools offered, or choice none),
        "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return "named" if isinstance(self.tool_choice, NamedToolChoice) else (self.tool_choice or "auto")

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_items(cls, v: Any) -> Any:
        if isinstance(v, list):
            items = sum(len(m[key]) for m in v if isinstance(m, dict)
                        for key in ("content", "tool_calls") if isinstance(m.get(key), list))
            if items > MAX_ITEMS:
                raise ValueError(f"the messages hold {items} content parts and tool calls; the limit is {MAX_ITEMS} in all")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        return stop_list(v)


def logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    """`logit_bias` as OpenAI takes it: token ids (as strings) -> -100..100."""
    for token, bias in (v or {}).items():
        if not (token.isascii() and token.isdigit() and len(token) <= 10):
            raise ValueError(f"keys are token ids, got {token[:24]!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"biases are -100..100, got {bias} for token {token}")
    return v


def stop_list(v: str | list[str] | None) -> list[str]:
    """`stop` as a list: up to 4 non-empty strings."""
    stops = [v] if isinstance(v, str) else list(v or [])
    if len(stops) > 4:
        raise ValueError("at most 4 stop sequences")
    if any(not s for s in stops):
        raise ValueError("stop sequences must be non-empty")
    return stops


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the text stage's prefix cache spared


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class AudioResponse(BaseModel):
    id: str
    data: str  # base64 of the encoded audio
    expires_at: int
    transcript: str


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    audio: AudioResponse | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None
    # Extension, n > 1 only: this choice's `omni_outputs` (n = 1 keeps them on the completion).
    omni_outputs: dict[str, dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _omni_outputs_when_set(self, handler) -> dict[str, Any]:
        # Left out when unset, so an n = 1 choice reads as it did before choices had their own.
        out = handler(self)
        if out.get("omni_outputs") is None:
            out.pop("omni_outputs", None)
        return out


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    # Extension: per-stage token ids of stages configured with `output: tokens`.
    omni_outputs: dict[str, dict[str, Any]] | None = None


class AudioDelta(BaseModel):
    id: str | None = None
    data: str | None = None
    transcript: str | None = None
    expires_at: int | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: AudioDelta | None = None
    tool_calls: list[ToolCallDelta] | None = None


class _KeepsFinishReason(BaseModel):
    """A choice whose `finish_reason` is written even when null (streams are dumped without
    nulls): OpenAI sends it on every chunk, and the legacy completion's type requires it."""

    @model_serializer(mode="wrap")
    def _with_finish_reason(self, handler):
        out = handler(self)
        out.setdefault("finish_reason", self.finish_reason)
        return out


class ChunkChoice(_KeepsFinishReason):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    # (`return_token_ids`) the text tokens behind this chunk: a choice's chunks add up to its ids.
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    omni_outputs: dict[str, dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None  # (`return_token_ids`: on the first choice's role chunk)


class CompletionRequest(_Body):
    """`POST /v1/completions` (OpenAI's legacy text completion): raw prompts, no chat template."""

    model: str
    # One prompt (text or token ids) or a batch of them (each answered with n choices).
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    suffix: str | None = None
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default, also for an explicit null (below)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # (larger did not fit the wire: a 500)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # The sampled token's log-probability and this many alternatives (OpenAI allows up to 5).
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    stop: str | list[str] | None = Field(None, validate_default=True)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    seed: Seed = None
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_salt: CacheSalt = None

    _bias = field_validator("logit_bias")(classmethod(lambda cls, v: logit_bias(v)))
    _stop_list = field_validator("stop")(classmethod(lambda cls, v: stop_list(v)))
    _stream_options = field_validator("stream_options")(classmethod(stream_options_need_stream))

    @field_validator("max_tokens")
    @classmethod
    def _default_max_tokens(cls, v: int | None) -> int:
        return 16 if v is None else v

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        if isinstance(v, list) and len(v) > MAX_PROMPTS and not isinstance(v[0], int):
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        if isinstance(v, list) and any(isinstance(p, list) and not p for p in v):
            raise ValueError("a token-id prompt must not be empty")
        return v


class LegacyLogprobs(BaseModel):
    """A completion's log-probabilities in the legacy format: per token its text, its
    log-probability, the most likely alternatives (text -> log-probability), its offset in `text`."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_KeepsFinishReason):
    index: int
    text: str
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class SpeechRequest(_Body):
    model: str
    input: str = Field(min_length=1, max_length=4096)
    voice: str | None = None
    response_format: str = "mp3"  # OpenAI's default
    speed: float = Field(1.0, ge=0.25, le=4.0, allow_inf_nan=False)
    instructions: str | None = None
    # "audio": the body is the audio file, streamed as it is made; "sse": OpenAI's
    # speech.audio.delta / speech.audio.done events.
    stream_format: Literal["audio", "sse"] = "audio"
    # Extension: seed of every sampling stage (talker, the vocoder's noise): same seed, same waveform.
    seed: Seed = None
    cache_salt: CacheSalt = None


class VoiceList(BaseModel):
    voices: list[str]
    default: str | None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omni-server"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
