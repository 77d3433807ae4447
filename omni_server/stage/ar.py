"""AR stage: vLLM's EngineCore in this process, driven by our loop (see base.Stage).

Each step sends per-request deltas to the api and, when a request with downstream consumers
finishes, its tokens and hidden states straight to those stages.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_server.config.loader import engine_arg_problems
from omni_server.config.schema import PipelineConfig
from omni_server.stage import model_classes, processors
from omni_server.stage.audio_clip import audio_clip_seconds
from omni_server.stage.base import Stage
from omni_server.stage.errors import client_text, server_fault
from omni_server.stage.hidden import EMIT_HIDDEN, MROPE_POSITIONS, STEP_EMBEDS
from omni_server.stage.prefix_rows import PREFIX_ROWS
from omni_server.stage.preparing import Preparer
from omni_server.stage.processors import StageInput
from omni_server.stage.scheduler import scheduler_cls_for
from omni_server.stop_strings import Detokenizer
from omni_server.wire.transport import StageSockets
from omni_server.wire.messages import (
    AddRequest,
    ExpectRequest,
    RequestDelta,
    AUDIO_SAMPLE_RATE,
    AUDIO_IN_VIDEO_OPTION,
    CACHE_SALT_OPTION,
    VIDEO_FPS,
    SamplingSpec,
    StagePayload,
)

log = logging.getLogger(__name__)


def _paired_ids(videos: list, tracks: list) -> dict[str, list[str]]:
    """vLLM's item ids for videos heard with their tracks: one per pair, from both. vLLM keys each
    item's processed and encoded forms by its own content, but a video's tokens and a track's depend
    on both: the same frames with another track took the cached layout of the first (a wrong reply,
    or the engine failed on the mismatch)."""
    out = []
    for frames, track in zip(videos, tracks):
        h = hashlib.blake2b(digest_size=32)  # (as long as vLLM's own item hashes: a collision shares cached media)
        for a in (frames, track):
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
        out.append(h.hexdigest())
    return {"video": out, "audio": out}


class _BadMedia(ValueError):
    """Media that are not what the api sends (the client's request: a 400)."""


class _NoRoom(ValueError):
    """A prompt the context cannot hold (the client's request: a 400)."""


class _OverContext(_NoRoom):
    """A prompt, or it and the max_tokens asked, longer than the context."""


_VLLM_TOO_LONG = "longer than the maximum model length"  # (vLLM's refusal of a prompt over the context)


@dataclass
class _Made:
    """A request vLLM's input processing made, ready to enter the engine."""

    request: Any  # vllm.v1.request.Request
    wave: int
    prompt_token_ids: list[int]
    prompt_len: int
    with_hidden: bool
    forward_to: list[int]
    hold: bool = False
    stop: list[str] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request in the engine whose result feeds later stages."""

    prompt_token_ids: list[int]
    forward_to: list[int]
    # Consumers that take this request's output in chunks while it runs, and how many positions
    # per chunk; what went out so far.
    stream_to: list[int] = field(default_factory=list)
    chunk: int = 8
    with_hidden: bool = True  # some consumer reads hidden states (else only tokens travel)
    sent_rows: int = 0
    sent_tokens: int = 0
    sent_units: int = 0  # (see chunk_ready)
    # Backpressure: output tokens each streaming consumer reported used, the consumers that need
    # no more, those that said they wait for input since the last chunk went out, and how far ahead
    # of the slowest the request may run (0: no limit).
    acked: dict[int, int] = field(default_factory=dict)
    done_to: set[int] = field(default_factory=set)
    starved: set[int] = field(default_factory=set)
    window: int = 0
    paused: bool = False  # held for backpressure right now
    hold: bool = False  # ended by itself, it goes downstream on the api's word (SamplingSpec.hold_output)
    output_token_ids: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    hidden_len: int = 0
    positions: torch.Tensor | None = None  # the prompt's M-RoPE positions (M-RoPE models only)
    # Models that complete each token into a frame (runner's StepPredictor): one row per fed output token.
    frames: list[torch.Tensor] = field(default_factory=list)
    sent_frames: int = 0
    # Trailing pieces of `hidden` that are still views of a step's capture buffer (pinned memory
    # shared by the step's requests): joined into one tensor of this request's own every
    # COMPACT_EVERY steps, so a long request does not pin every step buffer of its lifetime.
    loose: int = 0
    # Leading rows no longer held: every consumer had them in chunks and none takes them whole.
    dropped: int = 0
    # Prompt positions: the token ids', or the embedding rows' of a prompt given as embeddings
    # alone (no ids). Default: len(prompt_token_ids).
    prompt_len: int = -1
    end_id: int | None = None  # (see _keep_tokens)
    # The request's stop strings, read here as the api reads them (the same decoding): a streaming
    # consumer gets no token a stop string may start in, and a stop found cuts the request at once.
    stops: Detokenizer | None = None

    def __post_init__(self):
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt_token_ids)

    def clear_rows(self) -> int:
        """Rows a streaming consumer may have now: with stop strings, those of the tokens before any
        (a stop found later keeps them: _keep_tokens)."""
        return self.hidden_len if self.stops is None else min(self.hidden_len, self.prompt_len + self.stops.clear)

    def clear_tokens(self) -> int:
        """Output tokens a streaming consumer may have now (one past the rows': a consumer takes
        the newest as maybe the last, and never feeds the last on)."""
        n = len(self.output_token_ids)
        return n if self.stops is None else min(n, self.stops.clear + 1)

    def chunk_ready(self, rows_chunk: int | None = None) -> bool:
        """Whether the streaming consumers get a chunk now. Hidden rows: the prompt's once all are
        in (in the step that computed them: one piece, sent as a view of it, where joining it to
        the next row copied megabytes for a long prompt), then the first reply position's (the
        consumer starts on them, whatever the chunk size), then every `chunk` rows, or
        `rows_chunk` if fewer (see ARStage.rows_chunk). Tokens only: the
        first token, then whenever the output crosses a multiple of `chunk` (a consumer decoding
        windows of a multiple of `chunk` gets each one's last unit in the step that made it, not
        up to a chunk later). The unit is the frame for a
        model that completes its tokens into frames (they lag the tokens by one step and travel
        with them), else the token."""
        if self.with_hidden:
            n, prompt = self.clear_rows(), self.prompt_len
            if self.sent_rows < prompt:
                return n >= prompt
            chunk = self.chunk if rows_chunk is None else min(self.chunk, rows_chunk)
            return n > self.sent_rows and (self.sent_rows == prompt or n - self.sent_rows >= chunk)
        if self.clear_tokens() <= self.sent_tokens:
            return False
        return self.sent_tokens == 0 or self.units() // self.chunk > self.sent_units // self.chunk

    def units(self) -> int:
        return len(self.frames) if self.frames else len(self.output_token_ids)

    def mark_sent(self, tokens: int) -> None:
        """The first `tokens` tokens (and every frame so far) went out. (No frame exists yet at the
        first chunk, whatever the model: it counts none.)"""
        self.sent_units = self.units() if self.sent_tokens else len(self.frames)
        self.sent_tokens = tokens
        self.starved.clear()

    def too_far_ahead(self) -> bool:
        """Whether the slowest consumer is `window` tokens behind what went out. A consumer waiting
        for input is never behind: it runs as soon as the next chunk comes (it uses fewer positions
        than it was sent, so it can wait for input while `window` tokens behind)."""
        live = [c for c in self.stream_to if c not in self.done_to and c not in self.starved]
        if not live or not self.window:
            return False
        return self.sent_tokens - min(self.acked.get(c, 0) for c in live) >= self.window

    def compact(self) -> None:
        """Release the pieces already sent where no consumer takes the rows whole (a long prompt's
        rows: a copy of megabytes saved), then join the loose pieces left (their captures' copies
        must be done)."""
        if not any(d not in self.stream_to for d in self.forward_to):
            held, n = self.dropped, 0
            for piece in self.hidden:
                if held + len(piece) > self.sent_rows:
                    break
                held, n = held + len(piece), n + 1
            if n:
                last = self.hidden[n - 1]
                del self.hidden[:n]
                self.dropped, self.loose = held, min(self.loose, len(self.hidden))
                if not self.hidden:  # (a row-less piece keeps the rows' shape and dtype for _send_chunk)
                    self.hidden.append(torch.empty((0, *last.shape[1:]), dtype=last.dtype))
        if self.loose:
            self.hidden[-self.loose:] = [torch.cat(self.hidden[-self.loose:])]
            self.loose = 0


# Steps between joins of a request's loose hidden-state pieces: one copy per request per this many
# steps instead of one per step, at the price of up to this many step buffers held. A piece from a
# buffer of more than COMPACT_ROWS rows (a prefill step's) is joined at once instead.
COMPACT_EVERY = 16
COMPACT_ROWS = 256


def preload(cfg: PipelineConfig, stage_id: int) -> None:
    """Import what building the engine takes (most of a stage's start-up seconds before the engine
    itself), touching no GPU: a stage held back while another engine profiles its GPU does this first."""
    import importlib

    import vllm.engine.arg_utils  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.engine.input_processor  # noqa: F401
    import vllm.v1.executor  # noqa: F401
    from vllm.platforms import current_platform

    cpu = current_platform.device_type == "cpu"
    importlib.import_module("omni_server.stage.cpu_worker" if cpu else "omni_server.stage.gpu_worker")


# What a stage with a fixed KV size asks vLLM's start-up check to find free (1% of the card).
FIXED_KV_UTILIZATION = 0.01


# vLLM `additional_config` key: the modalities the stage turns off (a compile-cache factor only).
DISABLED_MODALITIES = "omni_disabled_modalities"


def disabled_modalities(args: dict[str, Any]) -> list[str]:
    """The modalities engine args turn off (limit 0; "*" for `language_model_only`), sorted."""
    if args.get("language_model_only"):
        return ["*"]
    limits = args.get("limit_mm_per_prompt") or {}
    count = lambda v: v.get("count", 999) if isinstance(v, dict) else v  # noqa: E731 (vLLM's two forms)
    return sorted(m for m, v in limits.items() if count(v) == 0)


def engine_config(cfg: PipelineConfig, stage_id: int):
    """The stage's VllmConfig, with the defaults `vllm serve` takes where the config is silent: an
    online server's (on a GPU of 70 GB or more a prefill takes up to 8,192 tokens a step instead of
    2,048, so a long prompt, e.g. a video's, is not cut into four steps)."""
    from vllm.usage.usage_lib import UsageContext

    return build_engine_args(cfg, stage_id).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def build_engine_args(cfg: PipelineConfig, stage_id: int):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    stage = cfg.stage(stage_id)
    # (a value EngineArgs takes as it is failed deep in the engine's start, naming no field)
    problems = engine_arg_problems(cfg, "config", stage_id)
    if problems:
        raise ValueError("; ".join(p.removeprefix("config: ") for p in problems))
    args: dict[str, Any] = dict(stage.engine_args)
    if stage.model_class:
        args = model_classes.engine_overrides(model_classes.get(stage.model_class), args)
    args.setdefault("model", stage.model)
    if args.get("kv_cache_memory_bytes") is not None:
        # vLLM's GPU worker refuses to start unless `gpu_memory_utilization` (0.92 by default) of the
        # card is free, even when the KV size is given and that fraction sizes nothing (its CPU worker
        # skips the check then). Stages sharing a GPU would trip it; the fixed KV size is the budget.
        args.setdefault("gpu_memory_utilization", FIXED_KV_UTILIZATION)
    if stage.tokenizer:
        args.setdefault("tokenizer", stage.tokenizer)
    if isinstance(args.get("structured_outputs_config"), dict):  # (EngineArgs takes only the object)
        from vllm.config import StructuredOutputsConfig

        args["structured_outputs_config"] = StructuredOutputsConfig(**args["structured_outputs_config"])
    on_cpu = current_platform.device_type == "cpu"
    args["worker_cls"] = (
        "omni_server.stage.cpu_worker.CPUOmniWorker" if on_cpu else "omni_server.stage.gpu_worker.GPUOmniWorker"
    )
    one_worker = all(int(args.get(k) or 1) == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                          "data_parallel_size"))
    if one_worker and "distributed_executor_backend" not in args:
        from omni_server.stage.executor import OneProcessExecutor

        args["distributed_executor_backend"] = OneProcessExecutor
    if stage.inputs:
        args.setdefault("enable_prompt_embeds", True)
    readers = [cfg.stage(c).name for c in cfg.consumers(stage_id) if processors.reads_hidden(cfg.stage(c).input_processor)]
    if readers and args.get("speculative_config"):
        # (the runner's capture does not handle drafted tokens, whose rows a verifying step may
        # reject: it leaves such steps to vLLM untouched, and they emit no rows)
        raise ValueError(f"stage {stage_id} ({stage.name}): engine_args.speculative_config: speculative decoding "
                         f"emits no hidden states, and {', '.join(readers)} reads them")
    if readers:
        # Consumers need a hidden row for every prompt position, cached prefixes included: the
        # runner keeps them beside the KV cache (stage/prefix_rows.py) while prefix caching is on.
        args["additional_config"] = {**(args.get("additional_config") or {}), PREFIX_ROWS: True}
    off = disabled_modalities(args)
    if off:
        # vLLM 0.26 keys its compile caches without the multimodal limits (vLLM issue 50891), yet a
        # model with every modality off traces its forward from token ids, not embeddings: a text-only
        # start after a media one (same cache dir) loaded the other's graph and died in it.
        args["additional_config"] = {**(args.get("additional_config") or {}), DISABLED_MODALITIES: off}
    if stage.omni_sampler:
        from omni_server.stage.sampling import LOGITS_PROCESSOR

        args["logits_processors"] = [*(args.get("logits_processors") or ()), LOGITS_PROCESSOR]
    return EngineArgs(**args)


def _check_token_ids(stage, vocab: int) -> None:
    """The config's token ids must be the model's: an id past its vocabulary failed every request
    as the client's bad logit_bias (400), whatever the request."""
    d = stage.default_sampling
    for field in ("stop_token_ids", "suppress_token_ids"):
        bad = [t for t in getattr(d, field) or [] if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stage {stage.id} ({stage.name}): default_sampling.{field}: {bad} not in the model's "
                             f"vocabulary (0-{vocab - 1})")


def _logit_bias(spec: SamplingSpec) -> dict[int, float]:
    """The request's biases, OpenAI's -100 made -inf (never sampled, as OpenAI means it), and the
    stage's suppressed tokens at -inf (vLLM clamps only its own API's biases)."""
    bias = {t: float("-inf") if b <= -100 else b for t, b in spec.logit_bias.items()}
    bias.update((t, float("-inf")) for t in spec.suppress_token_ids)
    return bias


class ARStage(Stage):
    def __init__(self, cfg: PipelineConfig, stage_id: int, sockets: StageSockets):
        from vllm.v1.engine.core import EngineCore
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.executor import Executor

        t0 = time.monotonic()
        super().__init__(cfg, stage_id, sockets)
        self.vllm_config = engine_config(cfg, stage_id)
        _check_token_ids(self.stage, self.vllm_config.model_config.get_vocab_size())
        sched = self.vllm_config.scheduler_config
        # Chosen after the platform settled async scheduling (on for GPUs, off on CPU).
        sched.scheduler_cls = scheduler_cls_for(sched.async_scheduling)
        self.dtype = self.vllm_config.model_config.dtype
        self.core = EngineCore(self.vllm_config, Executor.get_class(self.vllm_config), log_stats=False)
        # One renderer for the processor and its preprocessor (given none, each makes its own: two
        # multimodal processors and caches, and the one clear_mm_cache reaches is not the one used).
        self.inputs = InputProcessor(self.vllm_config, renderer_from_config(self.vllm_config))
        # The tokenizer's end of sequence (None without one): a stop string's cut ends with it (_keep_tokens).
        tokenizer = self.inputs.renderer.tokenizer
        self.end_id = None if tokenizer is None else tokenizer.eos_token_id
        self.decoder = getattr(tokenizer, "backend_tokenizer", None)  # (a `tokenizers.Tokenizer`: stop strings)
        self.tasks = self.core.get_supported_tasks()
        self.send_tokens = self.stage.output is not None
        self.tracked: dict[str, _Tracked] = {}
        self.in_engine: set[str] = set()
        self.preparing = Preparer()  # prompts in vLLM's input processing, off the loop
        # Requests that ended by themselves, their output held for the api's word (_Tracked.hold).
        self.holding: dict[str, _Tracked] = {}
        # The last step's hidden-state captures (their device -> host copies may be in flight),
        # and the requests to compact once they are done.
        self._in_flight: list = []
        self._compact_next: list[tuple[str, _Tracked]] = []
        # Requests whose input is still streaming in -> per-step rows handed to the runner so far,
        # and their sources.
        self.stream_in: dict[str, int] = {}
        self.stream_src: dict[str, list[int]] = {}
        self.core.scheduler.held = self._held
        # A stage streaming to or from another never preempts (scheduler._admissible says why).
        self.core.scheduler.reserve_kv = self.stage.input_mode == "stream" or any(
            cfg.stage(c).input_mode == "stream" for c in cfg.consumers(stage_id))
        # Load what the input processor needs now, not on the first request (seconds on a big model).
        prepare = getattr(self.processor, "prepare", None)
        if prepare is not None:
            prepare(self)
        self.audio_clip_s = audio_clip_seconds(self.vllm_config.model_config)
        model_class = model_classes.get(self.stage.model_class) if self.stage.model_class else None
        self.audio_in_video = model_class.audio_in_video if model_class else None
        self.video_tokens = model_class.video_tokens if model_class else None
        self.startup_s = time.monotonic() - t0

    # ---- base.Stage hooks ---------------------------------------------------------------------

    def has_work(self) -> bool:
        sched = self.core.scheduler
        if not sched.has_requests():
            return False
        # (skipped_waiting: requests a schedule passed over, e.g. their structured-output grammar
        # still compiling on vLLM's thread; they need the next steps to be admitted.)
        if sched.waiting or sched.skipped_waiting or sched.has_finished_requests() or self.core.batch_queue:
            return True  # (a batch in flight must be collected even if nothing new can run)
        # Else nothing to do until input or credit arrives.
        return any(not self._held(r) for r in sched.running)

    def _held(self, request) -> bool:
        rid = request.request_id
        given = self.stream_in.get(rid)
        # The step feeding output token j adds step row j: wait until it is here (once the input is
        # complete the last row repeats, so nothing waits).
        if given is not None and request.num_computed_tokens - request.num_prompt_tokens >= given:
            return True
        tracked = self.tracked.get(rid)
        if tracked is None:
            return False
        ahead = tracked.too_far_ahead()
        if ahead and not tracked.paused:
            self.backpressure_pauses += 1
        tracked.paused = ahead
        return ahead

    def credit(self, msg) -> None:
        tracked = self.tracked.get(msg.request_id)
        if tracked is None or msg.stage_id not in tracked.stream_to:
            return
        if msg.consumed < 0:
            tracked.done_to.add(msg.stage_id)
        else:
            tracked.acked[msg.stage_id] = max(tracked.acked.get(msg.stage_id, 0), msg.consumed)
            if msg.waiting:
                tracked.starved.add(msg.stage_id)

    def close(self) -> None:
        self.preparing.close()
        self.core.shutdown()

    def known_requests(self) -> set[str]:
        return self.in_engine | set(self.waiting) | set(self.tracked) | self.preparing.ids() | set(self.holding)

    def info(self) -> dict[str, str]:
        # The context length the engine settled on (the config may say -1, "auto", or nothing).
        info = {**super().info(), "max_model_len": str(self.vllm_config.model_config.max_model_len)}
        if self.audio_clip_s is not None:  # (the api refuses longer clips: the model would hear their start only)
            info["audio_clip_s"] = f"{self.audio_clip_s:g}"
        if self.audio_in_video is not None:
            info["audio_in_video"] = "1"
        return info

    def counts(self) -> tuple[int, int]:
        sched = self.core.scheduler
        return len(sched.running), len(sched.waiting) + len(self.preparing)

    def add_prompt(self, msg: AddRequest) -> None:
        # Media go through vLLM's multimodal processor on the worker (preparing.py says why), and so
        # does any prompt arriving while it has work: requests enter the engine in arrival order.
        if msg.tensors or not self.preparing.idle():
            self.preparing.submit(msg.request_id, lambda: self._make_prompt(msg))
            return
        try:
            made = self._make_prompt(msg)
        except Exception as e:
            self._reject(msg.request_id, e)
            return
        self._enter(msg.request_id, made)

    def _make_prompt(self, msg: AddRequest) -> _Made:
        try:
            prompt = self._prompt(msg)
        except _NoRoom:
            raise
        except Exception as e:  # media that are not what the api sends
            raise _BadMedia(f"bad media: {e}") from e
        return self._make(msg.request_id, prompt, msg.sampling, msg.forward_to,
                          cache_salt=msg.options.get(CACHE_SALT_OPTION))

    def admit_prepared(self) -> None:
        for request_id, job in self.preparing.done():
            try:
                made = job.result()
            except BaseException as e:  # (raised on the worker: whatever it is, it is this request's)
                self._reject(request_id, e)
                continue
            self._enter(request_id, made)

    def has_background(self) -> bool:
        return len(self.preparing) > 0

    def _prompt(self, msg: AddRequest) -> dict[str, Any]:
        # A typed dict is input vLLM takes as already processed; a prompt with media must go through
        # vLLM's multimodal processor (features, placeholder expansion), which an untyped one does.
        names = sorted(msg.tensors, key=_media_index)
        audio, images, videos = ([msg.tensors[k].numpy() for k in names if k.startswith(kind)]
                                 for kind in ("audio.", "image.", "video."))
        if not (audio or images or videos):
            return {"type": "token", "prompt_token_ids": msg.prompt_token_ids}
        prompt: dict[str, Any] = {"prompt_token_ids": msg.prompt_token_ids}
        if videos:  # (the rate the api sampled them at; processors assume their own otherwise)
            kwargs = prompt["mm_processor_kwargs"] = {"fps": VIDEO_FPS}
            if msg.options.get(AUDIO_IN_VIDEO_OPTION) == "1":
                if self.audio_in_video is None or len(audio) != len(videos):  # (the api sends one per video)
                    raise ValueError("audio in video: this stage's model cannot hear it, or the request has "
                                     "not one audio track per video")
                kwargs.update(self.audio_in_video(len(videos)))
                prompt["multi_modal_uuids"] = _paired_ids(videos, audio)
            self._check_video_room(msg.prompt_token_ids, videos, kwargs, msg.sampling)
        # Frames are read-only zmq memory; vLLM's processor gets arrays of its own.
        media = {"audio": [(a.copy(), AUDIO_SAMPLE_RATE) for a in audio], "image": [a.copy() for a in images],
                 "video": [a.copy() for a in videos]}
        prompt["multi_modal_data"] = {kind: items for kind, items in media.items() if items}
        return prompt

    def start(self, expect: ExpectRequest, stage_input: StageInput, final: bool = True) -> None:
        self._add(expect.request_id, stage_input.prompt, expect.sampling, expect.forward_to,
                  step_embeds=stage_input.step_embeds, positions=stage_input.positions,
                  cache_salt=expect.options.get(CACHE_SALT_OPTION))
        if not final and expect.request_id in self.in_engine:
            rows = stage_input.step_embeds
            self.stream_in[expect.request_id] = 0 if rows is None else len(rows)
            self.stream_src[expect.request_id] = list(expect.sources)

    def step_rows_given(self, request_id: str) -> int:
        return self.stream_in.get(request_id, 0)

    def extend(self, request_id: str, stage_input: StageInput, final: bool) -> None:
        if request_id not in self.stream_in:
            return  # finished or failed meanwhile
        rows = stage_input.step_embeds
        more = None if rows is None else rows[self.stream_in[request_id] - stage_input.step_offset:]
        if more is not None and len(more):
            # Reach the runner with the next step, before its forward.
            self.core.scheduler.queue_step_embeds(request_id, more, stage_input.step_ready)
            self.stream_in[request_id] += len(more)
            self.input_arrived(request_id)
        if final:
            self._end_stream(request_id)

    def _end_stream(self, request_id: str) -> list[int] | None:
        """Forget a streamed input's state; its sources (None: it was not streaming in)."""
        self.forget_use(request_id)
        sources = self.stream_src.pop(request_id, None)
        return sources if self.stream_in.pop(request_id, None) is not None else None

    def _add(self, request_id: str, prompt: dict, spec: SamplingSpec, forward_to: list[int],
             step_embeds: torch.Tensor | None = None, positions: torch.Tensor | None = None,
             cache_salt: str | None = None) -> None:
        try:
            made = self._make(request_id, prompt, spec, forward_to, step_embeds, positions, cache_salt)
        except Exception as e:
            self._reject(request_id, e)
            return
        self._enter(request_id, made)

    def _make(self, request_id: str, prompt: dict, spec: SamplingSpec, forward_to: list[int],
              step_embeds: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              cache_salt: str | None = None) -> _Made:
        """The engine's request for a prompt (vLLM's input processing: the part that may run off the
        loop, see preparing.py)."""
        if cache_salt:  # (vLLM hashes it into the first block, so every later block's hash differs too)
            own = prompt.get("cache_salt")  # (a processor's own, e.g. for positions the rows do not show)
            prompt = {**prompt, "cache_salt": f"{cache_salt}|{own}" if own else cache_salt}
        with_hidden = any(processors.reads_hidden(self.cfg.stage(c).input_processor) for c in forward_to)
        params = self._sampling_params(spec, emit_hidden=with_hidden, step_embeds=step_embeds, positions=positions)
        try:
            request = self.inputs.process_inputs(request_id, prompt, params, supported_tasks=self.tasks)
            # The engine's prompt: multimodal placeholders expanded to one token per embedding row
            # (an embeddings prompt has no ids: its rows are its positions).
            prompt_token_ids = list(request.prompt_token_ids or [])
            prompt_len = len(request.prompt_embeds) if request.prompt_token_ids is None else len(prompt_token_ids)
            if spec.max_tokens_param:
                self._check_room(prompt_len, spec)
            req, wave = self.core.preprocess_add_request(request)
        except Exception:
            if "multi_modal_data" in prompt:
                # vLLM's processor cache takes a request's media as sent to the engine's cache before
                # its last checks (the prompt's length with them): after a rejection a later request
                # with the same media would reach the engine without them (vLLM issue 46354). With
                # that cache forgotten, the next requests send theirs whole (and processed again once:
                # a rejected request costs the others' cache hits, never their correctness).
                self.inputs.renderer.clear_mm_cache()
            raise
        return _Made(req, wave, prompt_token_ids, prompt_len, with_hidden, list(forward_to), spec.hold_output,
                     list(spec.stop))

    def _check_video_room(self, prompt_ids: list[int], videos: list[np.ndarray], mm_kwargs: dict[str, Any],
                          spec: SamplingSpec) -> None:
        """Refuse a prompt whose videos cannot fit the context before vLLM's processor reads their
        frames (it checks the length only after: a 64 s video at 720p took ~8 s and ~3.7 GB of the
        tiny CPU thinker to be refused); counted by the model class where it can."""
        if self.video_tokens is None:
            return
        info = self.inputs.renderer.get_mm_processor().info
        hf_processor, kwargs = info.get_hf_processor(), info.ctx.get_merged_mm_kwargs(mm_kwargs)
        counts = [self.video_tokens(hf_processor, kwargs, *v.shape[:3]) for v in videos]
        if None in counts:
            return
        # (vLLM's encoder cache holds an item whole: one larger than it is refused after processing too)
        if max(counts) > self.inputs.mm_encoder_cache_size:
            raise _NoRoom(f"a video of {max(counts)} tokens ({VIDEO_FPS:g} frames a second) is more than this "
                          f"stage's encoder cache holds of one item, {self.inputs.mm_encoder_cache_size}; a shorter "
                          "or smaller video fits")
        # (each video is at least one placeholder among the prompt's ids: the rest are other tokens)
        n = len(prompt_ids) - len(videos) + sum(counts)
        context = self.vllm_config.model_config.max_model_len
        if n > context or (spec.max_tokens_param and n + spec.max_tokens > context):
            asked = f" and {spec.max_tokens_param} {spec.max_tokens}" if n <= context else ""
            raise _OverContext(f"this model's context is {context} tokens: the prompt's "
                          f"{'video takes' if len(videos) == 1 else f'{len(videos)} videos take'} "
                          f"{sum(counts)} of them ({VIDEO_FPS:g} frames a second), the prompt at least {n}{asked}; "
                          "a shorter or smaller video fits")

    def _check_room(self, n: int, spec: SamplingSpec) -> None:
        """A max_tokens the client set that the context cannot hold after the prompt as the engine runs
        it (`n` tokens, media expanded: the api counted only their placeholders) is the client's error,
        not a reply cut short as if it reached it."""
        context = self.vllm_config.model_config.max_model_len
        if n + spec.max_tokens > context:
            raise _OverContext(f"this model's context is {context} tokens: the prompt's {n} and "
                             f"{spec.max_tokens_param} {spec.max_tokens} do not fit")

    def _reject(self, request_id: str, e: BaseException) -> None:
        if isinstance(e, ValueError):  # vLLM's check of the request (too long, bad params), bad media: the client's
            log.warning("stage %d: rejected %s: %s", self.stage_id, request_id, client_text(e))  # (not the media it echoes)
            too_long = isinstance(e, _OverContext) or _VLLM_TOO_LONG in str(e)
            self.fail(request_id, f"stage {self.stage.name}: {client_text(e)}", code=400,
                      error_type="context_length_exceeded" if too_long else None)
        else:  # anything else is the server's: fail it, keep serving
            log.error("stage %d: could not add %s", self.stage_id, request_id, exc_info=e)
            self.fail(request_id, server_fault(f"stage {self.stage.name}: could not start the request", e))

    def _enter(self, request_id: str, made: _Made) -> None:
        try:
            self.core.add_request(made.request, made.wave)
        except Exception as e:
            self._reject(request_id, e)
            return
        self.in_engine.add(request_id)
        forward_to = made.forward_to
        if forward_to:
            stream_to = [c for c in forward_to if self.cfg.stage(c).input_mode == "stream"]
            chunk = min((self.cfg.stage(c).stream_chunk for c in stream_to), default=8)
            window = min((self.cfg.stage(c).stream_window for c in stream_to), default=0)
            # Stop strings read here when this stage can decode (else the api's word: hold).
            stops = Detokenizer(self.decoder, made.stop) if made.stop and self.decoder is not None else None
            self.tracked[request_id] = _Tracked(made.prompt_token_ids, list(forward_to), stream_to, chunk,
                                                with_hidden=made.with_hidden, window=window,
                                                prompt_len=made.prompt_len, hold=made.hold and stops is None,
                                                end_id=self.end_id, stops=stops)

    def _sampling_params(self, spec: SamplingSpec, emit_hidden: bool, step_embeds: torch.Tensor | None = None,
                         positions: torch.Tensor | None = None):
        from vllm import SamplingParams

        from omni_server.stage import sampling

        extra: dict[str, Any] = {}
        if emit_hidden:
            extra[EMIT_HIDDEN] = True
        if step_embeds is not None:
            extra[STEP_EMBEDS] = step_embeds
        if positions is not None:
            extra[MROPE_POSITIONS] = positions
        # (vLLM reads seed -1 as none; torch's generators take a seed modulo 2**64, so seed % 2**64
        # draws as the seed itself would)
        seed = None if spec.seed is None else spec.seed % 2**64
        drawn = {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k,
                 "repetition_penalty": spec.repetition_penalty, "seed": seed}
        structured = None
        if spec.json_object or spec.json_schema is not None:
            from vllm.sampling_params import StructuredOutputsParams

            # vLLM checks it (and a tokenizer) when the request is processed: a bad schema fails the request with 400.
            structured = StructuredOutputsParams(json=spec.json_schema, json_object=spec.json_object or None)
        if self.stage.omni_sampler and sampling.takes(spec.temperature, spec.top_k, spec.presence_penalty,
                                                      spec.frequency_penalty, spec.logprobs):
            drawn, extra[sampling.SPEC] = sampling.vllm_params(**drawn)
        return SamplingParams(
            max_tokens=spec.max_tokens, min_tokens=spec.min_tokens, **drawn,
            presence_penalty=spec.presence_penalty, frequency_penalty=spec.frequency_penalty, logprobs=spec.logprobs,
            stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos, detokenize=False,
            logit_bias=_logit_bias(spec) or None,
            structured_outputs=structured, extra_args=extra or None,
        )

    def finish_early(self, request_id: str, keep: int = -1) -> None:
        held = self.holding.pop(request_id, None)
        if held is not None:  # ended by itself before the api's word: cut and sent now
            if keep >= 0:
                _keep_tokens(held, keep)
            self._forward(request_id, held)
            return
        if request_id not in self.in_engine:
            return  # finished by itself meanwhile: its payload already went downstream
        self.core.abort_requests([request_id])
        self.core.scheduler.step_embeds_out.pop(request_id, None)
        tracked = self.tracked.get(request_id)
        if tracked is not None and keep >= 0:
            _keep_tokens(tracked, keep)
        self._finished(request_id, cut=True)
        self.send_outputs([RequestDelta(request_id=request_id, finished=True, finish_reason="stop")])

    def _finished(self, rid: str, cut: bool = False) -> None:
        """The request ended in the engine (by itself, or `cut` short): forget its streamed input,
        then send its output downstream (one that ended by itself and holds it: on the api's word)."""
        self.in_engine.discard(rid)
        streamed = self._end_stream(rid)
        if streamed is not None or rid in self.waiting:
            # Done before its streamed input was: drop the rest of that input, and tell the sources
            # to send no more.
            w = self.waiting.pop(rid, None)
            self.tombstone(rid)
            sources = streamed or (w.expect.sources if w and w.expect else [])
            self.send_credit(rid, sources, -1)
        tracked = self.tracked.pop(rid, None)
        if tracked is not None and tracked.hold and not cut:
            self.holding[rid] = tracked  # (_forward waits for its rows' copies when it goes)
        elif tracked is not None:
            self._forward(rid, tracked)

    def drop(self, request_ids: list[str]) -> None:
        in_engine = [r for r in request_ids if r in self.in_engine]
        if in_engine:
            self.core.abort_requests(in_engine)
        for rid in request_ids:
            self.preparing.cancel(rid)
            self.holding.pop(rid, None)
            self.in_engine.discard(rid)
            self.tracked.pop(rid, None)
            self._end_stream(rid)
            self.core.scheduler.step_embeds_out.pop(rid, None)

    # ---- engine step ------------------------------------------------------------------------

    def step(self) -> int:
        """Requests this step advanced: those it scheduled or, when it only collected a batch in
        flight (async scheduling's last step), those that batch returned."""
        scheduled = self.core.scheduler.scheduled
        outputs, executed = self.core.step_fn()
        scheduled = self.core.scheduler.scheduled - scheduled
        self.core.post_step(executed)
        # Last step's copies are done by now (the engine waited for that step's tokens).
        self._settle()
        for capture in self.core.scheduler.hidden_captures:
            self._collect_hidden(capture)
        self._in_flight = list(self.core.scheduler.hidden_captures)
        self.core.scheduler.hidden_captures.clear()
        for frames in self.core.scheduler.frames:
            for rid, (k, frame) in frames.items():
                tracked = self.tracked.get(rid)
                if tracked is not None and k == len(tracked.frames):
                    tracked.frames.append(frame)
        self.core.scheduler.frames.clear()
        if not outputs:
            return scheduled
        deltas: list[RequestDelta] = []
        stopped: dict[str, int] = {}  # requests a stop string ended, and the tokens before it
        chunk_due = False  # this step's rows or tokens complete a chunk for a streaming consumer
        rows_chunk = self.rows_chunk()
        for eco in outputs.values():
            for out in eco.outputs:
                rid = out.request_id
                finished = out.finish_reason is not None
                prefill = out.prefill_stats  # (on a request's first output only)
                if prefill is not None:
                    self.cached_tokens += prefill.num_cached_tokens
                tracked = self.tracked.get(rid)
                if tracked is not None:
                    tracked.output_token_ids.extend(out.new_token_ids)
                    if tracked.stops is not None and not tracked.stops.stopped:
                        tracked.stops.push(out.new_token_ids)
                        if tracked.stops.stopped:
                            stopped[rid] = tracked.stops.kept
                    chunk_due |= (bool(tracked.stream_to) and not finished and rid not in stopped
                                  and tracked.chunk_ready(rows_chunk))
                if self.send_tokens or finished:
                    reason = str(out.finish_reason) if finished else None
                    lp = out.new_logprobs if self.send_tokens else None
                    # The prompt as the engine runs it (media expanded to their tokens), for usage.
                    # A request that ends in its first step has left the scheduler: its prefill's count.
                    n_prompt = 0
                    if self.send_tokens:
                        req = self.core.scheduler.requests.get(rid)
                        n_prompt = (req.num_prompt_tokens if req is not None
                                    else prefill.num_prompt_tokens if prefill is not None else 0)
                    deltas.append(RequestDelta(
                        request_id=rid,
                        new_token_ids=list(out.new_token_ids) if self.send_tokens else [],
                        num_prompt_tokens=n_prompt,
                        num_cached_tokens=prefill.num_cached_tokens if prefill is not None and self.send_tokens else 0,
                        finished=finished,
                        finish_reason=reason,
                        error=f"stage {self.stage.name}: engine error" if reason == "error" else None,
                        # (columns past the request's own top-k pad the batch: the api drops them)
                        logprob_token_ids=lp.logprob_token_ids.tolist() if lp is not None else [],
                        logprobs=lp.logprobs.tolist() if lp is not None else [],
                    ))
                if finished:
                    keep = stopped.pop(rid, None)  # (ended by itself in the step that made a stop string)
                    if keep is not None:
                        _keep_tokens(tracked, keep)
                    self._finished(rid)
        # The client's tokens first: a long prompt's first chunk carries its hidden rows (15 MB for
        # 2,000 rows of the 7B thinker), and a burst of them must not hold up every request's text.
        if deltas:
            self.send_outputs(deltas)
        for rid, keep in stopped.items():  # (after the tokens: the api reads the stop string before the end)
            self.finish_early(rid, keep)
        if chunk_due:
            # Sent in this step, not the next (the talker reads one thinker row per step, token2wav
            # windows need whole runs of codes): wait for the rows' copy now (done or nearly: the
            # step's tokens are here). Sent before the compaction: the rows sent need no copy.
            self._wait_copies()
            self._stream_out(rows_chunk)
            self._settle()
        self._report_use()
        return max(scheduled, sum(len(eco.outputs) for eco in outputs.values()))

    def _report_use(self) -> None:
        """Credits to the sources of streamed inputs: step k used their output token k. Every
        `stream_chunk` used, and once whenever a request used every row it was given (it waits:
        its source must send more whatever its window)."""
        requests = self.core.scheduler.requests
        for rid, sources in self.stream_src.items():
            req = requests.get(rid)
            if req is None:
                continue
            used = req.num_computed_tokens - req.num_prompt_tokens
            self.report_use(rid, sources, used, waiting=used >= self.stream_in.get(rid, 0))

    def _wait_copies(self) -> None:
        for capture in self._in_flight:
            capture.wait()
        self._in_flight = []

    def _settle(self) -> None:
        """Wait for the last step's copies; compact the requests with many loose pieces or a big one."""
        self._wait_copies()
        for rid, tracked in self._compact_next:
            if self.tracked.get(rid) is tracked:  # (one that finished meanwhile was joined whole)
                tracked.compact()
        self._compact_next = []

    def _collect_hidden(self, capture) -> None:
        """Append each tracked request's rows (views: the copy may still be in flight)."""
        offset, big = 0, len(capture.hidden) > COMPACT_ROWS
        for rid, n, start in zip(capture.req_ids, capture.counts, capture.starts):
            tracked = self.tracked.get(rid)
            if tracked is not None:
                if rid in capture.positions:
                    tracked.positions = capture.positions[rid]
                if start < tracked.hidden_len:  # recomputed after preemption: drop the stale tail
                    _truncate(tracked, start)
                tracked.hidden.append(capture.hidden[offset : offset + n])
                tracked.loose += 1
                tracked.hidden_len += n
                if big or tracked.loose >= COMPACT_EVERY:
                    self._compact_next.append((rid, tracked))
            offset += n

    def rows_chunk(self) -> int:
        """Hidden rows per streamed chunk now, at most each consumer's `stream_chunk`: about two
        chunk messages per step whatever the batch, so one row per message while one or two
        requests run. A consumer that reads one row per step of its own and steps faster than
        this stage (the talker beside a big thinker) then waits for none, where chunks of 8 rows
        held up every few steps, and many requests still share a step's message count."""
        return max(1, len(self.core.scheduler.running) // 2)

    def _stream_out(self, rows_chunk: int) -> None:
        """A chunk (settled rows and tokens not sent yet) to each request's streaming consumers
        where one is ready (`_Tracked.chunk_ready`)."""
        for rid, tracked in self.tracked.items():
            if tracked.stream_to and tracked.chunk_ready(rows_chunk):
                self._send_chunk(rid, tracked, final=False)

    def _send_chunk(self, request_id: str, tracked: _Tracked, final: bool, rows: torch.Tensor | None = None,
                    end: int | None = None) -> None:
        """`rows`: all of the request's rows (its final chunk); else the rows not sent yet, up to
        `end` (default: all held), are taken from the last pieces only (joining every piece per
        chunk is quadratic in length; one piece is sent as a view of itself, not copied: a long
        prompt's rows are one piece)."""
        first = tracked.sent_rows == 0 and tracked.sent_tokens == 0
        if rows is not None:
            new, end = rows[tracked.sent_rows:], len(rows)
        else:
            end = tracked.clear_rows() if end is None else min(end, tracked.hidden_len)
            pieces, covered, skip = [], 0, tracked.hidden_len - end  # (rows past `end`: not sent)
            for piece in reversed(tracked.hidden):
                if covered >= tracked.hidden_len - tracked.sent_rows:
                    break
                pieces.append(piece)
                covered += len(piece)
            start = covered - (tracked.hidden_len - tracked.sent_rows)
            if not pieces:  # (all sent: an empty slice keeps the rows' shape and dtype)
                new = tracked.hidden[-1][:0] if tracked.hidden else torch.empty(0)
            elif len(pieces) == 1:
                new = pieces[0][start:max(len(pieces[0]) - skip, 0)]
            else:
                new = torch.cat(pieces[::-1])[start:max(covered - skip, 0)]
        tensors = {"hidden": new} if tracked.with_hidden else {}
        if first:
            tensors.update(_prompt_tensors(tracked))
        if len(tracked.frames) > tracked.sent_frames:
            tensors["codes"] = torch.stack(tracked.frames[tracked.sent_frames:])
            tracked.sent_frames = len(tracked.frames)
        tokens = len(tracked.output_token_ids) if final else tracked.clear_tokens()
        chunk = StagePayload(
            request_id=request_id, source_stage=self.stage_id,
            prompt_token_ids=tracked.prompt_token_ids if first else [],
            output_token_ids=tracked.output_token_ids[tracked.sent_tokens:tokens], tensors=tensors, final=final)
        tracked.sent_rows = max(end, tracked.sent_rows)
        tracked.mark_sent(max(tokens, tracked.sent_tokens))
        for dst in tracked.stream_to:
            if dst not in tracked.done_to:
                self.send_stage(dst, request_id, chunk)

    def _forward(self, request_id: str, tracked: _Tracked) -> None:
        for capture in self._in_flight:  # (its rows may be in this step's capture)
            capture.wait()
        # One row per fed position: prompt + every output token but the last (cut short by
        # finish_early, a step may have run one position further).
        rows = tracked.prompt_len + len(tracked.output_token_ids) - 1
        full_to = [d for d in tracked.forward_to if d not in tracked.stream_to]
        if not full_to:  # (streamed only: the rows not sent yet, without joining all of them)
            self._send_chunk(request_id, tracked, final=True, end=max(rows, 0))
            return
        hidden = torch.cat(tracked.hidden) if tracked.hidden else torch.empty(0)
        hidden = hidden[:rows]
        if tracked.stream_to:
            self._send_chunk(request_id, tracked, final=True, rows=hidden)
        payload = StagePayload(
            request_id=request_id, source_stage=self.stage_id,
            prompt_token_ids=tracked.prompt_token_ids, output_token_ids=tracked.output_token_ids,
            tensors={**({"hidden": hidden} if tracked.with_hidden else {}), **_prompt_tensors(tracked),
                     **({"codes": torch.stack(tracked.frames)} if tracked.frames else {})},
        )
        for dst in full_to:
            self.send_stage(dst, request_id, payload)


def _keep_tokens(tracked: _Tracked, keep: int) -> None:
    """Downstream reads the reply as if the model had ended it before the stop string: the `keep`
    tokens before it, then the end-of-sequence token in place of the stop string's first one. A
    consumer takes the last token as the end (it never feeds it on, as after a natural end), so the
    kept tokens are all spoken, and their rows are there (the stop's token was computed on the last
    of them). Never fewer tokens than a streaming consumer had already (those cannot be taken back),
    and at least one (a consumer starts on the first)."""
    sent = max(tracked.sent_tokens, tracked.sent_rows - tracked.prompt_len + 1)
    ids = tracked.output_token_ids
    n = max(keep + 1, sent, 1)
    del ids[n:]
    if n == keep + 1 > sent and len(ids) == n and tracked.end_id is not None:
        ids[keep] = tracked.end_id


def _prompt_tensors(tracked: _Tracked) -> dict[str, torch.Tensor]:
    """Per-prompt tensors that travel with the prompt ids (in a stream's first chunk)."""
    return {"mrope_positions": tracked.positions} if tracked.positions is not None else {}


def _media_index(name: str) -> int:
    tail = name.rpartition(".")[2]
    return int(tail) if tail.isdigit() else 0


def _truncate(tracked: _Tracked, length: int) -> None:
    if length <= tracked.dropped:  # (recomputed from before the rows held: their consumers had them)
        tracked.dropped = tracked.hidden_len = length
        tracked.hidden, tracked.loose = [], 0
        return
    kept, total = [], tracked.dropped
    for chunk in tracked.hidden:
        if total >= length:
            break
        kept.append(chunk[: length - total])
        total += kept[-1].shape[0]
    # The loose pieces are the last ones: those of them that were kept stay loose.
    tracked.loose = max(0, len(kept) - (len(tracked.hidden) - tracked.loose))
    tracked.hidden, tracked.hidden_len = kept, total
