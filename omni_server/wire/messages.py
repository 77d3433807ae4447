"""Messages between the api process and the stage processes (and stage to stage).

One module, one tagged union: every frame 0 on the wire decodes to exactly one of these Structs.
Tensors never travel inside frame 0; `codec.py` moves them to extra raw frames. Fields typed
`dict[str, Any]` named `tensors` hold torch tensors in memory and tensor references on the wire.
Bump WIRE_VERSION on any incompatible change.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

WIRE_VERSION = 8  # 8: RequestDelta.error_type (7: SamplingSpec.max_tokens_param; 6: SamplingSpec.stop; 5: RequestDelta.num_cached_tokens, StageStats.cached_tokens; 4: StageStats.underruns, underrun_s)
AUDIO_SAMPLE_RATE = 16000
VIDEO_FPS = 2.0  # frames a second the api keeps of a video; the first stage's processor is told so

# Request option names (AddRequest/ExpectRequest.options) the api sets and stages read.
VOICE_OPTION = "voice"  # the generator's / talker's voice
REPLY_FROM_OPTION = "reply_from"  # text-to-speech: prompt index where the given reply starts
SPEED_OPTION = "speed"  # text-to-speech: the listener plays the audio this much faster (the api stretches it)
# The request's prefix-cache salt: AR stages key its KV blocks by it too, so only requests with the
# same salt share cached prefixes (tenants that must not learn of each other's prompts by timing).
CACHE_SALT_OPTION = "cache_salt"
# "1": each video's audio track (sent as the request's audio inputs, one per video in order) is
# heard interleaved with its frames (the model class's `audio_in_video` says how to ask its processor).
AUDIO_IN_VIDEO_OPTION = "audio_in_video"


class _Msg(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    pass


class SamplingSpec(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Sampling settings for one request in one stage (mapped to vLLM SamplingParams by the stage)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_tokens: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted from the logit of every token in the output so far (presence) / times its count (frequency).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probabilities to return per output token: None = none, k = the sampled token's and the top k.
    logprobs: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Token ids that must never be sampled.
    suppress_token_ids: list[int] = []
    # Token id -> bias added to its logit (OpenAI's logit_bias; -100 reads as never).
    logit_bias: dict[int, float] = {}
    # Structured output: any JSON object, or JSON matching this JSON Schema (its JSON text).
    json_object: bool = False
    json_schema: str | None = None
    # The client's stop strings. The api cuts the text with them; a stage that can decode reads them
    # too, and sends downstream only tokens before a stop string (streamed or whole).
    stop: list[str] = []
    # The api reads this stage's text for stop strings: a request that ends by itself goes downstream
    # only on the api's FinishRequest (keep: the tokens before a stop; -1: all), so a stop found after
    # the stage ended still cuts what the next stage reads. (Taken only by a stage without a
    # tokenizer to read `stop` with.)
    hold_output: bool = False
    # The client set max_tokens (under this field's name): a prompt, as the stage runs it, that leaves
    # the context less room than that is refused (400), not cut short as if it reached it.
    max_tokens_param: str = ""


# ---- api -> stage ------------------------------------------------------------------------------


class AddRequest(_Msg):
    """Start a request in the first stage(s) of its route, from token ids the api rendered."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    # Stage ids that consume this stage's per-request payload (tokens + hidden states).
    forward_to: list[int] = []
    # Per-request choices for the stage's input processor / generator, e.g. {"voice": "Ethan"}.
    options: dict[str, str] = {}
    # The replica of each stage on the request's route that serves it (absent: replica 0).
    replicas: dict[int, int] = {}
    # Media of the prompt, in placeholder order per kind: "audio.N" mono float32 at
    # AUDIO_SAMPLE_RATE, "image.N" RGB uint8 [height, width, 3].
    tensors: dict[str, Any] = {}


class ExpectRequest(_Msg):
    """Announce a request whose input arrives from upstream stages as StagePayload messages."""

    request_id: str
    sampling: SamplingSpec
    sources: list[int]
    forward_to: list[int] = []
    options: dict[str, str] = {}
    replicas: dict[int, int] = {}


class AbortRequest(_Msg):
    request_ids: list[str]


class FinishRequest(_Msg):
    """Stop generating this request now and finish it as if it had ended by itself: its output so far
    still goes downstream (the api found a stop string in a stage's text)."""

    request_id: str
    # Output tokens that go downstream (those before the stop string); -1: all. Tokens already
    # streamed to a consumer stay sent.
    keep: int = -1


class StatsQuery(_Msg):
    nonce: int


class Shutdown(_Msg):
    pass


# ---- stage -> stage ----------------------------------------------------------------------------


class StagePayload(_Msg):
    """One request's output of a stage, for the stage(s) downstream: whole when the request
    finished, or, to a stage with `input_mode: stream`, in chunks while it runs: each chunk carries
    what is new since the last (prompt ids in the first only), the last one has `final`."""

    request_id: str
    source_stage: int
    prompt_token_ids: list[int]  # (empty for a prompt given as embeddings alone; its rows still lead "hidden")
    output_token_ids: list[int]
    # e.g. "hidden": [num_prompt + num_output - 1, hidden_size] final-layer hidden states.
    tensors: dict[str, Any] = {}
    final: bool = True


class StreamCredit(_Msg):
    """Consumer -> producer of a streamed input: how many of the request's output tokens the
    consumer has used (`consumed`), or -1 when it needs no more (it finished first). The producer
    runs at most the consumer's `stream_window` tokens ahead of it, except that a consumer which
    has used all it was sent and cannot step without more (`waiting`) always gets the next chunk:
    a consumer reads fewer positions than the producer sent (the talker's reply rows lag the
    thinker's tokens), so without it a window near the chunk size would stall both."""

    request_id: str
    stage_id: int  # the consumer
    consumed: int
    waiting: bool = False


# ---- stage -> api ------------------------------------------------------------------------------


class StageReady(_Msg):
    stage_id: int
    pid: int
    startup_s: float
    info: dict[str, str] = {}
    replica: int = 0
    # Random per stage process (a pid may repeat: a restarted container's): a new value at the same
    # address means the process restarted and the requests it held are gone.
    boot: int = 0


class RequestDelta(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What one engine step produced for one request in one stage."""

    request_id: str
    new_token_ids: list[int] = []
    num_prompt_tokens: int = 0
    # Of those, the prompt tokens a prefix cache hit spared (the request's first delta from the stage).
    num_cached_tokens: int = 0
    finished: bool = False
    # vLLM's finish reason ("stop", "length", "abort") or "error".
    finish_reason: str | None = None
    error: str | None = None
    # HTTP-like class of the error: 400 the request was invalid, 503 a stage is unavailable, 500 other.
    error_code: int = 500
    # OpenAI's code for the error where it has one ("context_length_exceeded": the prompt, with its
    # media expanded, or it and the max_tokens asked, are longer than the stage's context).
    error_type: str | None = None
    # Per new token (requests asking for logprobs): [sampled, top 1, ..., top k] ids and their
    # log-probabilities under the model (before temperature and penalties).
    logprob_token_ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    # Generation stages: e.g. "audio": float32 [samples] at `sample_rate`.
    tensors: dict[str, Any] = {}
    sample_rate: int = 0


class RequestOutputs(_Msg):
    stage_id: int
    deltas: list[RequestDelta]


class StageStats(_Msg):
    stage_id: int
    nonce: int
    num_running: int
    num_waiting: int
    # Requests the stage knows about (engine, expected inputs, buffered payloads).
    request_ids: list[str]
    steps: int = 0
    step_s: float = 0.0  # seconds spent in engine steps
    batch_sum: int = 0  # running requests summed over steps (/ steps = mean batch)
    # Times a running request paused because a streaming consumer was `stream_window` behind.
    backpressure_pauses: int = 0
    # Bytes of tensors this stage sent to other stages (per destination).
    payload_bytes: int = 0
    # Streamed audio pieces sent after their listener's audio ran out, and the seconds it was out.
    underruns: int = 0
    underrun_s: float = 0.0
    # Prompt tokens the stage's prefix cache spared (AR stages), summed over requests.
    cached_tokens: int = 0
    # Requests that sent their first output (downstream or to the client), and the seconds from
    # each one's arrival here (at the request's start, for every stage on its route) to that output.
    first_outputs: int = 0
    first_output_s: float = 0.0
    pid: int = 0
    startup_s: float = 0.0
    info: dict[str, str] = {}
    replica: int = 0
    boot: int = 0  # (StageReady's)


# StageStats' numbers: what it holds now, and what it did since it started (deltas over time are
# meaningful); both sum over replicas.
STAGE_GAUGES = ("num_running", "num_waiting")
STAGE_COUNTERS = ("steps", "step_s", "batch_sum", "backpressure_pauses", "payload_bytes", "first_outputs",
                  "first_output_s", "underruns", "underrun_s", "cached_tokens")


Message = Union[
    AddRequest,
    ExpectRequest,
    AbortRequest,
    FinishRequest,
    StatsQuery,
    Shutdown,
    StagePayload,
    StreamCredit,
    StageReady,
    RequestOutputs,
    StageStats,
]
