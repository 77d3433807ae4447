"""FastAPI app: thin routes over the Orchestrator."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import Body, FastAPI, Form, HTTPException, Request, UploadFile, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from omni_server.api import audio, completions, errors, media, realtime, responses, tools, transcription
from omni_server.api.errors import APIError
from omni_server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SpeechRequest,
    VoiceList,
    lone_surrogate,
    not_unicode,
)
from omni_server.api.runs import BodyCut, Completion, Run, SpeechStream, TextCompletionRun, Transcript, typed_events
from omni_server.api.text import TextCodec
from omni_server.config.schema import PipelineConfig
from omni_server.orchestrator.orchestrator import RESTARTING, Orchestrator, RequestState, StageUnavailable
from omni_server.wire.messages import (AUDIO_IN_VIDEO_OPTION, AUDIO_SAMPLE_RATE, CACHE_SALT_OPTION, REPLY_FROM_OPTION, SPEED_OPTION,
                                       STAGE_COUNTERS, STAGE_GAUGES, VOICE_OPTION, SamplingSpec)

log = logging.getLogger(__name__)


class ServerState:
    """Everything the routes need; built by `serve` (or tests) before the app starts."""

    def __init__(self, cfg: PipelineConfig, orchestrator_factory: Callable[[], Orchestrator],
                 on_startup: Callable[["ServerState"], Awaitable[None]] | None = None):
        self.cfg = cfg
        self.orchestrator_factory = orchestrator_factory
        self.on_startup = on_startup
        self.orch: Orchestrator | None = None
        stage0 = cfg.stage(0)
        template = cfg.server.chat_template
        self.text = TextCodec(stage0.tokenizer or stage0.model,
                              Path(os.path.expanduser(template)).read_text() if template else None)
        self.text_stage = next((s.id for s in cfg.stages if s.output == "text"), None)
        audio_stage = cfg.output_stage("audio")
        self.audio_stage = audio_stage.id if audio_stage else None
        self.sampling_stage = self.text_stage if self.text_stage is not None else 0
        self.api_key = cfg.server.api_key or os.environ.get("OMNI_SERVER_API_KEY") or None
        self.created = int(time.time())
        # /metrics' read of the stages' stats in progress: scrapes that come meanwhile share it (the
        # route is open: 32 clients scraping in a loop doubled chat latency with a read each).
        self.stats_read: asyncio.Future | None = None

    @property
    def prompt_limit(self) -> int | None:
        """Prompt tokens allowed: over-long prompts are refused before streaming starts (stage 0
        would refuse them anyway): `server.max_prompt_tokens`, and stage 0's context length as its
        engine settled it (reported when ready), less room for one generated token."""
        limits = [self.cfg.server.max_prompt_tokens] if self.cfg.server.max_prompt_tokens else []
        if self.context:
            limits.append(self.context - 1)
        return min(limits, default=None)

    def _stage0(self, key: str) -> str | None:
        """What stage 0 reported as `key` when ready (None: not reported, or not ready)."""
        ready = self.orch.stage_info(0) if self.orch is not None else None
        return ready.info.get(key) if ready is not None else None

    @property
    def context(self) -> int:
        """Stage 0's context length as its engine settled it; 0: not known."""
        return int(self._stage0("max_model_len") or 0)

    @property
    def audio_clip_s(self) -> float | None:
        """Seconds of a clip stage 0's processor reads, where it cuts longer ones; None: whole clips,
        or not known."""
        clip = self._stage0("audio_clip_s")
        return float(clip) if clip else None

    @property
    def hears_video_audio(self) -> bool | None:
        """Whether stage 0 can hear a video's audio track with its frames; None: not known yet."""
        ready = self.orch.stage_info(0) if self.orch is not None else None
        return None if ready is None else ready.info.get("audio_in_video") == "1"

    def voices(self) -> list[str]:
        """Voices of the audio stage (reported by the stage when it is ready)."""
        ready = None if self.audio_stage is None or self.orch is None else self.orch.stage_info(self.audio_stage)
        if ready is None:
            return []
        listed = ready.info.get("voices", "")
        return [v for v in listed.split(",") if v]

    def check_voice(self, voice: str | None, param: str) -> str:
        voices = self.voices()
        if not voices:
            raise APIError(503, "the audio stage is not ready")
        if voice is None:
            return voices[0]
        # Case-insensitive ("ethan" and "Ethan" alike; checkpoints disagree on the case); the
        # checkpoint's own spelling goes to the stages.
        known = {v.lower(): v for v in voices}
        if voice.lower() not in known:
            raise APIError(400, f"unknown voice {voice!r}; available voices: {', '.join(voices)}", param=param)
        return known[voice.lower()]


def _check_format(fmt: str, param: str) -> str:
    try:
        audio.content_type(fmt)
    except audio.AudioError as e:
        raise APIError(400, str(e), param=param) from None
    return fmt.lower()


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.orch = state.orchestrator_factory()
        state.orch.start()
        task = asyncio.create_task(state.on_startup(state)) if state.on_startup else None
        try:
            yield
        finally:
            if task:
                task.cancel()
            await state.orch.close()

    app = FastAPI(title="omni-server", version="0.1.0", lifespan=lifespan)
    errors.install(app)

    app.add_middleware(BodyLimit, limit=state.cfg.server.max_request_bytes)
    app.add_middleware(KeyGuard, key=state.api_key)  # (outermost: before any body is read)

    @app.get("/health")
    async def health():
        """200 once every stage was ready and while each has a ready replica. Per stage: "ready"
        (every replica), "degraded" (some), "down", "restarting" (down, a new process starting) or
        "starting"; pids per process."""
        orch = state.orch
        cfg = state.cfg
        stages, pids = {}, {}
        for s in cfg.stages:
            units = [(s.id, r) for r in range(s.replicas)]
            up = [u for u in units if orch and u in orch.ready]
            down = [u for u in units if orch and u in orch.down]
            restarting = down and all(orch.down[u].startswith(RESTARTING) for u in down)
            stages[s.name] = ("ready" if len(up) == len(units) else "degraded" if up else
                              "restarting" if restarting else "down" if down else "starting")
            pids.update({cfg.unit_name(u): orch.ready[u].pid for u in up})
        ok = orch is not None and orch.serving
        return JSONResponse({"status": "ok" if ok else "unavailable", "stages": stages, "pids": pids},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        """Prometheus text format: request outcomes, TTFT / first-audio / duration histograms,
        audio seconds, and every ready stage replica's stats (read now). Like /health, no API key."""
        orch = state.orch
        if orch is None:
            raise APIError(503, "the pipeline is still starting")
        m = orch.metrics
        m.in_flight.set(len(orch.requests))
        units = [(s, r) for s in state.cfg.stages for r in range(s.replicas)]

        async def sample(stage, replica):
            if (stage.id, replica) not in orch.ready:
                return None
            try:
                return await orch.stats(stage.id, replica, timeout=2.0)
            except asyncio.TimeoutError:
                return None

        async def read() -> None:
            for (stage, replica), stats in zip(units, await asyncio.gather(*(sample(s, r) for s, r in units))):
                m.stage_sample(stage.name, replica, stats)

        if state.stats_read is None or state.stats_read.done():
            state.stats_read = asyncio.ensure_future(read())
        await asyncio.shield(state.stats_read)  # (a scrape that goes away leaves the read to the others)
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.cfg.model, created=state.created)])

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str) -> ModelCard:
        _check_model(state, model)  # (model ids may hold slashes: `Qwen/Qwen2.5-Omni-7B`)
        return ModelCard(id=state.cfg.model, created=state.created)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.logprobs and state.text_stage is None:
            raise APIError(400, f"model `{state.cfg.model}` has no text output for logprobs", param="logprobs")
        completion = await _start_chat(state, body, "chatcmpl")
        if body.stream:
            return await _streamed(request, completion, completion.sse)
        return await _until_disconnect(request, completion.collect(), completion.abort)

    @app.post("/v1/responses")
    async def create_response(raw: Annotated[dict[str, Any], Body()], request: Request):
        """OpenAI's Responses API, text out: the request as a chat turn (responses.to_chat) on the
        chat path, answered as a Response object or its typed event stream."""
        where = lone_surrogate(raw)  # (before `metadata` and the rest are echoed or read)
        if where is not None:
            raise APIError(400, not_unicode(where), param=where)
        try:
            body = ChatCompletionRequest.model_validate(responses.to_chat(raw))
        except ValidationError as e:
            raise RequestValidationError(responses.request_errors(e.errors(), raw)) from None
        body._max_tokens_name = "max_output_tokens"
        _check_model(state, body.model)
        if state.text_stage is None:
            raise APIError(400, f"model `{state.cfg.model}` has no text output", param="model")
        decoded, prompt_ids = await _chat_prompt(state, body, param="input")
        sampling = _sampling(state, body)
        _check_room(state, [prompt_ids], body)
        orch = _orch(state)
        [req] = await _submit(state, orch, [f"resp-{uuid.uuid4().hex}"], [prompt_ids], [sampling],
                              {"text"}, _stage_options({}, body), decoded)
        out = responses.ResponseRun(Run(state, orch, req, body, prompt_ids), raw, state.cfg.model)
        if body.stream:
            return await _streamed(request, out, lambda first: typed_events(out.events(first), out.abort, named=True))
        return await _until_disconnect(request, out.collect(), out.abort)

    @app.websocket("/v1/realtime")
    async def realtime_session(ws: WebSocket, model: str | None = None, intent: str | None = None):
        """OpenAI's Realtime API (api/realtime/): each response a chat turn over the session's
        conversation on the chat path; with `intent=transcription`, audio turns transcribed."""
        await ws.accept()
        refusal = None
        if model is not None and model != state.cfg.model:
            refusal = ("model_not_found", "model", f"model `{model}` is not served here; this server serves "
                                                   f"`{state.cfg.model}`")
        elif intent not in (None, "transcription"):
            refusal = ("invalid_value", "intent", "`intent` is transcription, or left out (a conversation)")
        elif intent == "transcription" and state.text_stage is None:
            refusal = ("invalid_value", "intent", f"model `{state.cfg.model}` has no text output to transcribe with")
        if refusal is not None:
            code, param, message = refusal
            await ws.send_json({"type": "error", "event_id": f"event_{uuid.uuid4().hex[:20]}", "error": {
                "type": "invalid_request_error", "code": code, "param": param, "event_id": None, "message": message}})
            await ws.close(code=1008)
            return
        lock = asyncio.Lock()

        async def send(event: dict) -> None:
            async with lock:  # (the response's task and the receive loop both send)
                await ws.send_text(json.dumps(event))

        voices = state.voices() if state.audio_stage is not None else []
        session = realtime.Session(state.cfg.model, send, lambda body: _realtime_run(state, body), voices=voices,
                                   has_audio=state.audio_stage is not None, max_buffer_s=state.cfg.server.max_audio_seconds,
                                   audio_cap=media.cap(state.cfg, "audio"), clip_s=state.audio_clip_s,
                                   context=state.context, image_cap=media.cap(state.cfg, "image"),
                                   kind=intent or "realtime", max_event_bytes=state.cfg.server.max_request_bytes,
                                   max_tokens_limit=state.cfg.server.max_tokens_limit,
                                   image_limits=(state.cfg.server.max_request_bytes, state.cfg.server.max_image_pixels),
                                   transcription_turn=None if state.text_stage is None else lambda language, prompt:
                                   transcription.messages(state.cfg.server, transcription.instruction(
                                       state.cfg.server, language, prompt)))
        try:
            await session.start()
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("text") is None:
                    await session.receive("")  # (binary frames: an error event)
                    continue
                await session.receive(message["text"])
        except (WebSocketDisconnect, RuntimeError):  # (gone while sending)
            pass
        finally:
            await session.close()

    @app.post("/v1/completions")
    async def text_completion(body: CompletionRequest, request: Request):
        """OpenAI's legacy completion: raw prompts, the text stage alone, `n` choices per prompt."""
        _check_model(state, body.model)
        if state.text_stage is None:
            raise APIError(400, f"model `{state.cfg.model}` has no text output", param="model")
        completions.check(body)
        prompts = await asyncio.to_thread(completions.prompts, state.text, body.prompt)
        for prompt_ids in prompts:
            _check_prompt(state, prompt_ids, param="prompt")
        chat = completions.chat_body(body)
        sampling = _sampling(state, chat)
        _check_room(state, prompts, chat)
        orch = _orch(state)
        completion_id, n, total = f"cmpl-{uuid.uuid4().hex}", body.n, len(prompts) * body.n
        # Choice k answers prompt k // n, seeded as a chat's choice k % n.
        reqs = await _submit(state, orch, _request_ids(completion_id, total), [prompts[k // n] for k in range(total)],
                             [_choice_sampling(sampling, k % n) for k in range(total)], {"text"}, _stage_options({}, body))
        echoes = await asyncio.to_thread(completions.echoes, state.text, body.prompt, prompts) if body.echo \
            else [""] * len(prompts)
        done = TextCompletionRun(completion_id, [Run(state, orch, req, chat, prompts[k // n], index=k)
                                               for k, req in enumerate(reqs)], [echoes[k // n] for k in range(total)])
        if body.stream:
            return await _streamed(request, done, done.sse)
        return await _until_disconnect(request, done.collect(), done.abort)

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest, request: Request):
        """Speak `input` through the pipeline: the text stage reads it as its own reply (one
        prefill, nothing generated), the later stages turn that into audio."""
        _check_model(state, body.model)
        if state.audio_stage is None:
            raise APIError(400, f"model `{state.cfg.model}` has no audio output", param="model")
        fmt = _check_format(body.response_format, "response_format")
        voice = state.check_voice(body.voice, "voice")
        prefix = await asyncio.to_thread(state.text.render_chat, [{"role": "user", "content": body.input}])
        reply = await asyncio.to_thread(state.text.encode_as_text, body.input)
        if not reply:
            raise APIError(400, "input has no speakable text", param="input")
        prompt_ids = prefix + reply
        _check_prompt(state, prompt_ids, param="input")
        sampling = _sampling(state, None, seed=body.seed)
        first = state.cfg.stage(0).id
        sampling[first].max_tokens, sampling[first].ignore_eos = 1, True
        orch = _orch(state)
        request_id = f"speech-{uuid.uuid4().hex}"
        options = {VOICE_OPTION: voice, REPLY_FROM_OPTION: str(len(prefix))}
        if body.speed != 1.0:  # (the audio stage's playback model: its listener plays that much faster)
            options[SPEED_OPTION] = repr(body.speed)
        [req] = await _submit(state, orch, [request_id], [prompt_ids], [sampling], {"audio"}, _stage_options(options, body))

        speech_out = SpeechStream(state, orch, req, fmt, n_input=len(reply), speed=body.speed)
        if body.stream_format == "sse":
            return _AbortingStream(speech_out.sse(), speech_out.abort)
        # The bytes stream as the audio is made; the first piece is awaited here so that a request
        # failing before any audio gets a proper error status.
        first = await _until_disconnect(request, speech_out.first(), speech_out.abort)
        if isinstance(first, Response):
            return first
        return _AbortingStream(speech_out.raw(first), speech_out.abort, audio.content_type(fmt))

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request, file: UploadFile, model: Annotated[str, Form()],
                             language: Annotated[str | None, Form(max_length=32)] = None,
                             prompt: Annotated[str | None, Form(max_length=4096)] = None,
                             response_format: Annotated[str, Form()] = "json",
                             temperature: Annotated[float, Form(ge=0, le=1)] = 0.0,
                             stream: Annotated[bool, Form()] = False,
                             max_tokens: Annotated[int | None, Form(ge=1)] = None):
        """The uploaded audio transcribed by the text stage: the audio and an instruction as one
        chat turn (`transcription`), greedy unless `temperature` says otherwise."""
        try:
            text = transcription.instruction(state.cfg.server, language, prompt)
        except transcription.LanguageError as e:
            raise APIError(400, str(e), param="language") from None
        turn = transcription.messages(state.cfg.server, text)
        return await _audio_to_text(state, request, "transcribe", file, model, turn, response_format, temperature,
                                    stream, max_tokens)

    @app.post("/v1/audio/translations")
    async def translations(request: Request, file: UploadFile, model: Annotated[str, Form()],
                           prompt: Annotated[str | None, Form(max_length=4096)] = None,
                           response_format: Annotated[str, Form()] = "json",
                           temperature: Annotated[float, Form(ge=0, le=1)] = 0.0,
                           max_tokens: Annotated[int | None, Form(ge=1)] = None):
        """The uploaded audio's speech as English text (OpenAI's translations: no streaming)."""
        turn = transcription.messages(state.cfg.server, transcription.translation(state.cfg.server, prompt))
        return await _audio_to_text(state, request, "translate", file, model, turn, response_format, temperature,
                                    False, max_tokens)

    @app.get("/v1/audio/voices")
    async def voices() -> VoiceList:
        names = state.voices()
        if state.audio_stage is not None and not names:
            raise APIError(503, "the audio stage is not ready")
        return VoiceList(voices=names, default=names[0] if names else None)

    @app.get("/v1/omni/stages/{stage_id}/stats")
    async def stage_stats(stage_id: int):
        """Summed over the stage's ready replicas, each one's own under `replicas`; the others
        under `down`, with why."""
        orch = _orch(state)
        if not 0 <= stage_id < len(state.cfg.stages):
            raise APIError(404, f"no stage {stage_id}")
        units = [(stage_id, r) for r in range(state.cfg.stage(stage_id).replicas)]
        down = [{"replica": r, "reason": orch.down.get((s, r), "starting")} for s, r in units if (s, r) not in orch.ready]
        if len(down) == len(units):
            raise APIError(503, f"stage {stage_id} is unavailable: {orch.unavailable([stage_id])}")
        try:
            per = [await orch.stats(s, r) for s, r in units if (s, r) in orch.ready]
        except asyncio.TimeoutError:
            raise APIError(503, f"stage {stage_id} did not answer") from None
        numbers = STAGE_GAUGES + STAGE_COUNTERS
        replicas = [{"replica": s.replica, "request_ids": s.request_ids, **{k: getattr(s, k) for k in numbers}}
                    for s in per]
        total = {k: sum(r[k] for r in replicas) for k in numbers}
        return {"stage_id": stage_id, **total, "request_ids": sorted(i for r in replicas for i in r["request_ids"]),
                "replicas": replicas, "down": down}

    return app


class KeyGuard:
    """ASGI middleware: with an API key set, every /v1 request must carry it (`Authorization: Bearer
    KEY`), checked before its body is read or parsed (an unauthenticated body cost the api its
    parse: 0.4 s and 430 MB for 15 MB of JSON). /health and /metrics stay open."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if self.key is not None and scope["type"] in ("http", "websocket") and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key.encode()):
                if scope["type"] == "websocket":  # (refused before the handshake: an HTTP 403)
                    await receive()
                    return await send({"type": "websocket.close", "code": 1008})
                body = errors.error_body(401, "invalid or missing API key", code="invalid_api_key")
                return await JSONResponse(body, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: bodies over `limit` bytes get a 413, whether or not they declare a length
    (chunked uploads are counted as they arrive, so nothing unbounded is buffered)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = HTTPException(413, f"request body exceeds {self.limit} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await JSONResponse(errors.error_body(413, too_large.detail), status_code=413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_large  # FastAPI passes HTTPExceptions raised while reading the body through
            return message

        await self.app(scope, counted, send)


def _orch(state: ServerState) -> Orchestrator:
    if state.orch is None:
        raise APIError(503, "server is starting")
    return state.orch


def _check_model(state: ServerState, model: str) -> None:
    if model != state.cfg.model:
        raise APIError(404, f"The model `{model}` does not exist. Available: {state.cfg.model}",
                       param="model", code="model_not_found")


def _check_prompt(state: ServerState, prompt_ids: list[int], param: str = "messages") -> None:
    limit = state.prompt_limit
    if limit is not None and len(prompt_ids) > limit:
        raise APIError(400, f"prompt has {len(prompt_ids)} tokens, the limit is {limit}", param=param,
                       code="context_length_exceeded")


def _check_room(state: ServerState, prompts: list[list[int]], body: ChatCompletionRequest) -> None:
    """A max_tokens the client set that the context cannot hold after the prompt is a 400 (as
    OpenAI's and vLLM's), not a reply cut short as if it reached it; the configured default is cut to
    fit by the engine. (Where stage 0 samples the text: its context is the one that counts.)"""
    asked, context = body.max_completion_tokens or body.max_tokens, state.context
    longest = max(map(len, prompts), default=0)
    if asked is not None and context and state.sampling_stage == 0 and longest + asked > context:
        raise APIError(400, f"this model's context is {context} tokens: the prompt's {longest} and "
                            f"{body.max_tokens_param()} {asked} do not fit", param=body.max_tokens_param(),
                       code="context_length_exceeded")


async def _chat_prompt(state: ServerState, body: ChatCompletionRequest,
                       param: str = "messages") -> tuple[dict[str, Any], list[int]]:
    """A chat body's decoded media and its prompt (the rendered template), checked against the limit."""
    if body.audio_in_video() and state.hears_video_audio is False:
        raise APIError(400, f"model `{state.cfg.model}` cannot hear a video's audio track (stage 0's model class "
                            "takes no use_audio_in_video)", param="mm_processor_kwargs.use_audio_in_video")
    decoded = await media.decode_media(state.cfg, body, state.audio_clip_s, param=param)
    # (In a thread, as everything below that scales with the body: a prompt of megabytes takes
    # seconds to render and tokenize, and the event loop serves every other request meanwhile.)
    if body.tool_mode() and not await asyncio.to_thread(lambda: state.text.writes_tools):
        raise APIError(400, "this model's chat template writes no tools into the prompt: the model would not "
                            "know them (server.chat_template can name a template that does)", param="tools")
    messages = [media.template_message(m) for m in body.messages]
    offered = [t.model_dump(exclude_none=True) for t in body.tools or []]
    prompt_ids = await asyncio.to_thread(state.text.render_chat, messages, offered)
    _check_prompt(state, prompt_ids, param=param)
    return decoded, prompt_ids


def _check_tools(state: ServerState, body: ChatCompletionRequest, outputs: set[str]) -> None:
    """Tool calls come as text from the text stage (api/tools.py), not spoken."""
    mode = body.tool_mode()
    if mode is None:
        return
    if state.text_stage is None:
        raise APIError(400, f"model `{state.cfg.model}` has no text output for tool calls", param="tools")
    if "audio" in outputs:
        raise APIError(400, "tool calls come as text: with `tools`, ask for modalities [\"text\"] (or set "
                            "tool_choice none)", param="modalities")
    if mode != "auto" and body.response_format is not None:
        raise APIError(400, f"tool_choice {mode if mode == 'required' else 'naming a function'} shapes the "
                            "reply as the calls' JSON: it cannot also follow response_format", param="response_format")


async def _audio_to_text(state: ServerState, request: Request, kind: str, file: UploadFile, model: str,
                         turn: list[dict[str, Any]], response_format: str, temperature: float, stream: bool,
                         max_tokens: int | None):
    """An uploaded audio file and the chat `turn` that asks about it (its audio placeholder the
    upload), answered by the text stage alone: OpenAI's transcription / translation responses."""
    _check_model(state, model)
    if state.text_stage is None:
        raise APIError(400, f"model `{state.cfg.model}` has no text output", param="model")
    if not media.takes_audio(state.cfg):
        raise APIError(400, f"model `{state.cfg.model}` takes no audio input (stage 0's limit_mm_per_prompt)",
                       param="file")
    if response_format in transcription.TIMED_FORMATS:
        raise APIError(400, f"response_format {response_format} needs timestamps, which this model does "
                            f"not produce; use one of {', '.join(transcription.FORMATS)}", param="response_format")
    if response_format not in transcription.FORMATS:
        raise APIError(400, f"response_format must be one of {', '.join(transcription.FORMATS)}",
                       param="response_format")
    limits = state.cfg.server
    try:
        wave = await media.off_loop(audio.decode_audio, await file.read(), target_rate=AUDIO_SAMPLE_RATE,
                                    max_bytes=limits.max_request_bytes, max_seconds=limits.max_audio_seconds)
    except audio.AudioError as e:
        raise APIError(400, f"file: {e}", param="file") from None
    import torch

    clips = transcription.pieces(wave, state.audio_clip_s, AUDIO_SAMPLE_RATE)
    prompt_ids = await asyncio.to_thread(state.text.render_chat, turn)
    _check_prompt(state, prompt_ids)
    # (A chat body for the shared sampling and output code; its messages are not read.)
    body = ChatCompletionRequest(model=model, messages=[{"role": "user", "content": "-"}], modalities=["text"],
                                 temperature=temperature, max_tokens=max_tokens)
    sampling = _sampling(state, body)
    orch = _orch(state)
    transcript_id = f"{kind}-{uuid.uuid4().hex}"
    reqs = await _submit(state, orch, _request_ids(transcript_id, len(clips)), [prompt_ids] * len(clips),
                         [sampling] * len(clips), {"text"}, {}, [{"audio.0": torch.from_numpy(c)} for c in clips])
    transcript = Transcript(transcript_id, [Run(state, orch, req, body, prompt_ids) for req in reqs])
    if stream:
        return await _streamed(request, transcript, transcript.sse)
    text = await _until_disconnect(request, transcript.text(), transcript.abort)
    if isinstance(text, Response):
        return text
    if response_format == "text":
        return Response(text, media_type="text/plain; charset=utf-8")
    return {"text": text, "usage": transcript.usage()}


def _stage_options(options: dict[str, str], body) -> dict[str, str]:
    """The request's options plus what stages read of its body: its prefix-cache salt, when it gave
    one (every AR stage uses it), and whether its videos' audio tracks are heard (chat)."""
    if body.cache_salt:
        options[CACHE_SALT_OPTION] = body.cache_salt
    if isinstance(body, ChatCompletionRequest) and body.audio_in_video():
        options[AUDIO_IN_VIDEO_OPTION] = "1"
    return options


def _modalities(state: ServerState, body: ChatCompletionRequest) -> set[str]:
    """The output kinds of this request: the requested modalities, or all the pipeline has."""
    available = {s.output for s in state.cfg.stages if s.output in ("text", "audio")}
    if body.modalities is None:
        return {s.output for s in state.cfg.stages if s.output}
    wanted = set(body.modalities)
    missing = wanted - available
    if missing:
        raise APIError(400, f"model `{state.cfg.model}` cannot output {', '.join(sorted(missing))}; "
                            f"it outputs {', '.join(sorted(available))}", param="modalities")
    if "audio" in wanted and "text" in available:
        wanted.add("text")  # (speech comes with its transcript, its stop strings and usage: ["audio"] = both)
    return wanted


async def _submit(state: ServerState, orch: Orchestrator, request_ids: list[str], prompts: list[list[int]],
                  samplings: list[dict[int, SamplingSpec]], outputs: set[str], options: dict[str, str],
                  media: dict[str, Any] | list[dict[str, Any]] | None = None) -> list[RequestState]:
    """One pipeline request per id (a chat's choices; a completion's prompts x choices; a
    transcription's clips), each with its prompt and sampling, and the media (or each its own: a
    list), all or none: the limit counts them all, and if one is refused those already submitted
    are aborted."""
    limit, n = state.cfg.server.max_concurrent_requests, len(request_ids)
    per_call = min(limit, state.cfg.server.max_requests_per_call)
    if n > per_call:  # (never admitted, however long the client retries)
        raise APIError(400, f"this request needs {n} pipeline requests (prompts x n); the server's "
                            f"limit is {per_call} per request", param="n")
    free = limit - orch.in_flight()  # (a stream whose client reads slowly holds no slot once the pipeline is done)
    if n > free:
        says = (f"is at its limit of {limit} concurrent requests" if n == 1 else
                f"has {max(free, 0)} of its {limit} concurrent request slots free, this request needs {n}")
        raise APIError(429, f"server {says}; retry shortly", headers={"Retry-After": "1"})
    reqs: list[RequestState] = []
    try:
        for k, (request_id, prompt_ids, sampling) in enumerate(zip(request_ids, prompts, samplings)):
            own = media[k] if isinstance(media, list) else media
            reqs.append(await orch.submit(request_id, prompt_ids, sampling, outputs, options, own))
    except StageUnavailable as e:
        raise APIError(503, f"pipeline unavailable: {e}") from None
    finally:
        if len(reqs) < n:  # refused, failed or cancelled part way: also the one being submitted
            for request_id in request_ids[:len(reqs) + 1]:  # (registered before its sends)
                await orch.abort(request_id)
    return reqs


def _request_ids(completion_id: str, count: int) -> list[str]:
    """The pipeline request ids of a completion's choices (one choice: the completion's own)."""
    return [completion_id] if count == 1 else [f"{completion_id}-{k}" for k in range(count)]


def _choice_dump(choice: Any) -> Any:
    return choice.model_dump() if hasattr(choice, "model_dump") else choice


def _choice_sampling(sampling: dict[int, SamplingSpec], index: int) -> dict[int, SamplingSpec]:
    """Choice `index`'s sampling: every seeded stage's seed + index, so seeded choices differ from
    each other yet the whole response is reproducible (choice 0 samples as an n = 1 request does)."""
    return {i: s if s.seed is None else msgspec.structs.replace(s, seed=s.seed + index) for i, s in sampling.items()}


def _sampling(state: ServerState, body: ChatCompletionRequest | None,
              seed: int | None = None) -> dict[int, SamplingSpec]:
    """Per-stage sampling: the YAML defaults, the chat request's fields on its text stage, and the
    request's seed (the chat body's, or `seed`) on every stage that samples (thinker, a sampling
    talker, the vocoder's noise): same seed, same reply and waveform."""
    out: dict[int, SamplingSpec] = {}
    if body is not None and body.seed is not None:
        seed = body.seed
    cap = state.cfg.server.max_tokens_limit
    for s in state.cfg.stages:
        d = s.default_sampling
        spec = SamplingSpec(
            max_tokens=d.max_tokens or 256, temperature=1.0 if d.temperature is None else d.temperature,
            top_p=d.top_p or 1.0, top_k=d.top_k or 0, seed=d.seed,
            repetition_penalty=d.repetition_penalty or 1.0, stop_token_ids=list(d.stop_token_ids or []),
            suppress_token_ids=list(d.suppress_token_ids or []))
        if seed is not None:
            spec.seed = seed
        if body is not None and s.id == state.sampling_stage:
            max_tokens = body.max_completion_tokens or body.max_tokens
            if max_tokens is not None:
                if max_tokens > cap:
                    name = body.max_tokens_param()
                    raise APIError(400, f"{name} {max_tokens} exceeds the limit of {cap}", param=name)
                spec.max_tokens = max_tokens
                spec.max_tokens_param = body.max_tokens_param()
            spec.stop = list(body.stop or [])
            spec.hold_output = bool(body.stop)  # (runs.Run releases it: the same condition)
            if body.temperature is not None:
                spec.temperature = body.temperature
            if body.top_p is not None:
                spec.top_p = body.top_p
            if body.top_k is not None:
                spec.top_k = max(body.top_k, 0)
            if body.repetition_penalty is not None:
                spec.repetition_penalty = body.repetition_penalty
            spec.presence_penalty = body.presence_penalty or 0.0
            spec.frequency_penalty = body.frequency_penalty or 0.0
            if body.logprobs:
                spec.logprobs = body.top_logprobs or 0
            spec.ignore_eos = body.ignore_eos
            if body.logit_bias:
                spec.logit_bias = _check_bias(state, body.logit_bias)
            fmt = body.response_format
            if fmt is not None and fmt.type == "json_object":
                spec.json_object = True
            elif fmt is not None and fmt.type == "json_schema":
                spec.json_schema = json.dumps(fmt.json_schema.json_schema)
            calls = tools.choice_schema([t.model_dump() for t in body.tools or []], _choice_dump(body.tool_choice),
                                        body.parallel_tool_calls) if body.tool_mode() in ("named", "required") else None
            if calls is not None:  # (the reply is the calls' JSON: decoded to match it)
                spec.json_schema = json.dumps(calls)
        spec.max_tokens = min(spec.max_tokens, cap)
        out[s.id] = spec
    return out


def _check_bias(state: ServerState, bias: dict[str, float]) -> dict[int, float]:
    vocab = len(state.text.tokenizer)
    out = {int(t): b for t, b in bias.items()}
    bad = sorted(t for t in out if t >= vocab)
    if bad:
        raise APIError(400, f"logit_bias: token ids {bad[:5]} are not in the vocabulary (size {vocab})",
                       param="logit_bias")
    return out


async def _start_chat(state: ServerState, body: ChatCompletionRequest, id_prefix: str, voice_param: str = "audio.voice",
                      ceiling: bool = False) -> Completion:
    """A chat body checked and submitted: one pipeline request per choice, with ids derived from the
    completion's (n = 1: its own). `ceiling`: max_tokens bounds the reply instead of being refused
    when the context cannot hold it after the prompt (the Realtime API's max_output_tokens)."""
    outputs = _modalities(state, body)
    _check_tools(state, body, outputs)
    decoded, prompt_ids = await _chat_prompt(state, body)
    options = _stage_options({}, body)
    audio_format = None
    if "audio" in outputs:
        options[VOICE_OPTION] = state.check_voice(body.audio.voice if body.audio else None, voice_param)
        audio_format = _check_format(body.audio.format if body.audio else "wav", "audio.format")
    sampling = _sampling(state, body)
    if ceiling:  # (a reply runs to the context at most)
        for spec in sampling.values():
            spec.max_tokens_param = ""
    else:
        _check_room(state, [prompt_ids], body)
    orch = _orch(state)
    completion_id = f"{id_prefix}-{uuid.uuid4().hex}"
    reqs = await _submit(state, orch, _request_ids(completion_id, body.n), [prompt_ids] * body.n,
                         [_choice_sampling(sampling, i) for i in range(body.n)], outputs, options, decoded)
    return Completion(completion_id, [Run(state, orch, req, body, prompt_ids, audio_format, index=i)
                                      for i, req in enumerate(reqs)])


async def _realtime_run(state: ServerState, raw: dict[str, Any]) -> Run:
    """A Realtime response's chat turn (one choice, streamed), checked and submitted as
    /v1/chat/completions would."""
    try:
        body = ChatCompletionRequest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg"))) from None
    [run] = (await _start_chat(state, body, "rt", voice_param="audio.output.voice", ceiling=True)).runs
    return run


async def _until_disconnect(request: Request, work: Awaitable[Any], abort: Callable[[], Awaitable[None]]):
    """Run a non-streaming request; `abort()` drops its pipeline request(s) in every stage if the
    client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await abort()
                return JSONResponse(errors.error_body(499, "client disconnected"), status_code=499)
    except asyncio.CancelledError:
        task.cancel()
        await abort()
        raise


async def _streamed(request: Request, run: Run | Completion, sse: Callable[[Any], AsyncIterator[str]]) -> Response:
    """`run` as an event stream, `sse(first output)`. The first output (of every choice) is awaited
    before the status line: a request the stages refuse (a bad JSON schema, say) gets an error
    status, not a 200 stream holding an error event."""
    first = await _until_disconnect(request, run.first(), run.abort)
    if isinstance(first, Response):
        return first
    return _AbortingStream(sse(first), run.abort)


class _AbortingStream(StreamingResponse):
    """An event stream that ends its pipeline requests however the response ends. `sse`'s own
    clean-up runs only once its generator started, and a client gone before the first chunk never
    starts it (on an ASGI 2.4 server the status line's send fails and the response raises)."""

    def __init__(self, body: AsyncIterator[str | bytes], abort: Callable[[], Awaitable[None]],
                 media_type: str = "text/event-stream"):
        super().__init__(body, media_type=media_type)
        self._abort = abort

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BodyCut:
            pass  # (returning before the last chunk: the server closes the connection, the body cut short)
        finally:
            await self._abort()  # (a no-op for requests that ended)
