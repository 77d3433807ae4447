"""A Realtime session: one WebSocket's conversation (or a transcription session's turns), its client
events in, its server events out; turns found in its audio (`turns.py`), responses run as `Reply`s."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from omni_server.api import image
from omni_server.api.errors import APIError
from omni_server.api.realtime import encode, events
from omni_server.api.realtime.encode import RATE
from omni_server.api.realtime.events import MIN_COMMIT_S, EventError
from omni_server.api.realtime.reply import Context, Reply
from omni_server.api.turns import TurnDetector

log = logging.getLogger(__name__)

_KEPT_BUFFERS = 4  # a conversation keeps at most this many full input buffers of audio
_KEPT_PROMPTS = 4  # ... and this many prompts' worth of images (16 where a prompt's images are not limited)
_TRANSCRIBING = 2  # transcriptions a session runs at once (the rest wait: one socket never fills the server)
_KEPT_ITEMS = 1024  # the items a conversation holds (each at most an event's size)


class Session:
    """One WebSocket's conversation. `send(event)` writes one server event; `start_chat(body)` starts
    a chat completion request (a dict as /v1/chat/completions takes) and returns its `Run`."""

    def __init__(self, model: str, send: Callable[[dict], Awaitable[None]],
                 start_chat: Callable[[dict], Awaitable[Any]], *, voices: list[str], has_audio: bool,
                 max_buffer_s: float, audio_cap: int | None, clip_s: float | None = None, context: int = 0,
                 transcription_turn: Callable[[str | None, str | None], list[dict]] | None = None,
                 image_cap: int | None = 0, image_limits: tuple[int, int] = (0, 0), kind: str = "realtime",
                 max_event_bytes: int | None = None, max_tokens_limit: int = 4096):
        self.model, self._send, self.start_chat = model, send, start_chat
        # "realtime": a conversation with responses; "transcription" (`?intent=transcription`): each
        # committed turn of audio transcribed, no responses
        self.kind = kind
        self.max_event_bytes = max_event_bytes  # (a client event's most bytes, as an HTTP body's)
        self.max_tokens_limit = max_tokens_limit  # (max_output_tokens "inf": the server's most, within the context)
        self.voices, self.has_audio = voices, has_audio
        self.max_buffer_bytes = int(max_buffer_s * RATE) * 2
        # The longest audio item: what stage 0 hears of one clip (None: whole clips), within the buffer;
        # a detected turn is committed at this length.
        self.max_item_bytes = min(self.max_buffer_bytes, int(clip_s * RATE) * 2 if clip_s else self.max_buffer_bytes)
        # Audio items a response's prompt may hold (stage 0's limit_mm_per_prompt; None: any), and the
        # audio a conversation keeps in all (what the server holds for one socket).
        self.audio_cap = audio_cap
        self.max_kept_bytes = _KEPT_BUFFERS * self.max_buffer_bytes
        # Images a prompt may hold (stage 0's limit_mm_per_prompt; 0: none taken; None: any), those a
        # conversation keeps, and an image's (data URL bytes, pixels) limits.
        self.image_cap, self.image_limits = image_cap, image_limits
        self.max_kept_images = _KEPT_PROMPTS * (image_cap or 4)
        # (language, prompt) -> the transcription chat turn, its audio part a {"type": "audio"}
        # placeholder; None: the pipeline cannot transcribe (no text stage).
        self.transcription_turn = transcription_turn
        self.transcribing: dict[str, asyncio.Task] = {}
        self.transcribers = asyncio.Semaphore(_TRANSCRIBING)
        self.read_as: dict[str, str] = {}  # the session's own transcripts (no input transcription asked)
        self.id = events.new_id("sess")
        if kind == "transcription" and transcription_turn is None:
            raise ValueError(f"model `{model}` has no text output to transcribe with")
        self.config: dict[str, Any] = {
            "instructions": None, "output_modalities": ["audio"] if has_audio else ["text"],
            "voice": voices[0] if voices else None, "max_output_tokens": "inf",
            "speed": 1.0,  # (spoken replies time-stretched to this speed, pitch kept: stretch.py)
            # The client's audio formats ("audio/pcm": 24 kHz PCM16, as kept; "audio/pcmu" / "audio/pcma":
            # G.711 at 8 kHz, converted as it streams)
            "input_format": encode.PCM, "output_format": encode.PCM,
            "temperature": None,  # (an extension, as the beta API had: None, the text stage's default)
            "transcription": None,  # {"model", "language", "prompt"}: user audio items transcribed
            "turn_detection": events.turn_detection({"type": "server_vad"}, kind),  # (None: the client ends each turn)
            # auto: a response's prompt leaves out the oldest items the context cannot hold, and the
            # oldest audio gives way past what a session keeps; disabled: errors instead
            "truncation": "auto",
            "include": None,  # (["item.input_audio_transcription.logprobs"]: transcripts with their tokens' logprobs)
        }
        if kind == "transcription":
            self.config["transcription"] = {"model": model, "language": None, "prompt": None}
        self.first_kept: str | None = None  # the oldest item the next response's prompt holds (truncation)
        # Where the last prompt started, when the reply after it moved `first_kept` on to leave room
        # for the next one: an estimate from that prompt's size, undone when the prompt shrinks.
        self.room_from: str | None = None
        self.shrinks = 0  # items truncated or deleted so far (a reply's prompt size is stale after one)
        self.context = context  # stage 0's context length (0: not known)
        self.items: list[dict[str, Any]] = []  # the conversation, as the client sees its items
        self.audio_of: dict[str, bytes] = {}  # a user audio item's PCM16
        self.images_of: dict[str, list[str]] = {}  # a user item's images (data URLs), one an input_image part
        self.spoken_ms: dict[str, int] = {}  # an assistant audio item's length (conversation.item.truncate)
        self.buffer = bytearray()
        self.inbound = None  # (the input format's rate conversion, carried from append to append)
        self.buffer_at = 0  # the session's sample index of buffer[0] (turn detection cuts the buffer)
        self.detector = self._detector(self.config["turn_detection"])
        self.turn_item: str | None = None  # the item id a detected turn will commit as
        # After a turn cut at the buffer's size: the sample by which the speech going on opens the next
        # turn, which then takes all the buffer (None: no cut pending).
        self.cut_short: int | None = None
        self.response: asyncio.Task | None = None
        self.reply: Reply | None = None
        self.idle: asyncio.Task | None = None  # (server_vad's idle_timeout_ms: the timer running)
        self.making: asyncio.Task | None = None  # (the timer's task once it makes its response)
        self.played_until = 0.0  # (loop time at which the last response's audio has played)
        # A response being made (its checks and start, before `response` is set): no second one meanwhile
        self.creating = False
        self.closed = False

    # ---- events out ------------------------------------------------------------------------

    async def send(self, kind: str, **fields) -> None:
        """One event to the client; once the socket is gone (closed, or a send failed), none."""
        if self.closed:
            return
        try:
            await self._send({"type": kind, "event_id": events.new_id("event"), **fields})
        except Exception as e:  # (the socket went away under a task's send: the receive loop ends the session)
            log.info("realtime %s: the client is gone (%s)", self.id, type(e).__name__)
            self.closed = True

    async def error(self, e: EventError | APIError, client_event_id: str | None) -> None:
        code = e.code if isinstance(e, EventError) else (e.code or "invalid_request_error")
        kind = "invalid_request_error" if isinstance(e, EventError) or e.status < 500 else "server_error"
        await self.send("error", error={"type": kind, "code": code, "message": e.message, "param": e.param,
                                        "event_id": client_event_id})

    def session_object(self) -> dict[str, Any]:
        c = self.config
        if self.kind == "transcription":
            return {"type": "transcription", "object": "realtime.transcription_session", "id": self.id,
                    "include": c["include"], "audio": {"input": {"format": encode.FORMATS[c["input_format"]],
                                                                 "turn_detection": c["turn_detection"],
                                                         "transcription": c["transcription"], "noise_reduction": None}}}
        return {
            "type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model,
            "output_modalities": c["output_modalities"], "instructions": c["instructions"] or "",
            "max_output_tokens": c["max_output_tokens"], "temperature": c["temperature"], "tools": [],
            "truncation": c["truncation"], "include": c["include"],
            "tool_choice": "auto",
            "audio": {"input": {"format": encode.FORMATS[c["input_format"]], "turn_detection": c["turn_detection"],
                                "transcription": c["transcription"]},
                      "output": {"format": encode.FORMATS[c["output_format"]], "voice": c["voice"],
                                 "speed": c["speed"]}},
        }

    # ---- events in -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.send("session.created", session=self.session_object())

    async def receive(self, text: str) -> None:
        """One client event (a JSON text frame)."""
        event_id = None
        try:
            # (a character is 1 to 4 bytes: the exact count only where it could matter)
            if self.max_event_bytes is not None and len(text) > self.max_event_bytes // 4 and (
                    len(text) > self.max_event_bytes or len(text.encode("utf-8", "surrogatepass")) > self.max_event_bytes):
                raise EventError(f"the event is over {self.max_event_bytes} bytes (`server.max_request_bytes`, "
                                 "as a request body's limit)", code="event_too_large")
            try:
                event = json.loads(text)
            except ValueError:
                raise EventError("the event is not JSON", code="invalid_json") from None
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise EventError("an event is a JSON object with a string `type`", param="type")
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            handlers = _TRANSCRIPTION_HANDLERS if self.kind == "transcription" else _HANDLERS
            handler = handlers.get(event["type"])
            if handler is None:
                raise EventError(f"unsupported event type {event['type']!r} (a {self.kind} session takes: "
                                 f"{', '.join(sorted(handlers))})", code="unsupported_event", param="type")
            events.only(event, events.EVENT_FIELDS[event["type"]], "")
            await handler(self, event)
        except (EventError, APIError) as e:
            await self.error(e, event_id)
        except Exception:  # (the server's fault: said, and the session goes on)
            log.exception("realtime %s: event failed", self.id)
            await self.send("error", error={"type": "server_error", "code": None, "param": None,
                                            "message": "the server failed on this event", "event_id": event_id})

    async def close(self) -> None:
        """The socket is gone: abort the running response, transcriptions and the idle timer."""
        self.closed = True
        self._disarm_idle()
        if self.making is not None:
            self.making.cancel()
        tasks = list(self.transcribing.values())  # (none start once closed)
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._responding():
            await self._cancel("client_cancelled", gone=True)

    async def _session_update(self, event: dict) -> None:
        given = event.get("session")
        if not isinstance(given, dict):
            raise EventError("`session` must be an object", param="session")
        if given.get("type", self.kind) != self.kind:
            raise EventError(f"this is a {self.kind} session: its type is set when it opens (a transcription "
                             "session: /v1/realtime?intent=transcription)", param="session.type")
        known = events.TRANSCRIPTION_FIELDS if self.kind == "transcription" else events.SESSION_FIELDS
        events.only(given, known, "session")
        if self.kind == "transcription" and isinstance(given.get("audio"), dict):
            events.only(given["audio"], {"input"}, "session.audio")
        config = self._settings(given, "session")
        if given.get("model") not in (None, self.model):
            raise EventError(f"this session serves `{self.model}`", code="model_not_found", param="session.model")
        if "include" in given:
            config["include"] = events.include(given["include"])
        if given.get("prompt") is not None:
            raise EventError("stored prompts are not served: send `instructions`", param="session.prompt")
        sound = given.get("audio") or {}
        heard, spoken = sound.get("input") or {}, sound.get("output") or {}
        events.only(heard, {"format", "transcription", "turn_detection", "noise_reduction"}, "session.audio.input")
        events.only(spoken, {"format", "voice", "speed"}, "session.audio.output")
        if heard.get("noise_reduction") is not None:
            raise EventError("`noise_reduction` is not served (null)", param="session.audio.input.noise_reduction")
        if spoken.get("speed") is not None:
            config["speed"] = events.speed(spoken["speed"], "session.audio.output.speed")
        if "turn_detection" in heard:
            config["turn_detection"] = events.turn_detection(heard["turn_detection"], self.kind)
        if "transcription" in heard:
            config["transcription"] = self._transcription(heard["transcription"])
            if config["transcription"] is None and self.kind == "transcription":
                raise EventError("a transcription session transcribes: `transcription` is {model, language, "
                                 "prompt}, not null", param="session.audio.input.transcription")
        for where, fmt in (("input", heard.get("format")), ("output", spoken.get("format"))):
            if fmt is not None:
                config[f"{where}_format"] = events.audio_format(fmt, f"session.audio.{where}.format")
        if config["input_format"] != self.config["input_format"]:
            self.inbound = encode.converter(config["input_format"], up=True)
        retimed = config["turn_detection"] != self.config["turn_detection"]
        if retimed:
            self.detector = self._detector(config["turn_detection"])  # (a turn under way is dropped)
            self.turn_item = self.cut_short = None
        self.config = config
        if retimed and not self._responding() and not self.creating:
            self._arm_idle()  # (counted under the new settings, or not at all)
        await self.send("session.updated", session=self.session_object())

    def _detector(self, vad: dict[str, Any] | None) -> TurnDetector | None:
        if vad is None:
            return None
        vad = events.gate(vad)
        return TurnDetector(RATE, vad["threshold"], vad["silence_duration_ms"], at=self.buffer_at + len(self.buffer) // 2)

    def _settings(self, given: dict, where: str) -> dict[str, Any]:
        """The session's settings with those a session.update or response.create gives (`where`)."""
        config = dict(self.config)
        if given.get("tools"):
            raise EventError("tools are not served by /v1/realtime here (chat completions take them)",
                             param=f"{where}.tools")
        if given.get("tool_choice") not in (None, "auto", "none"):
            raise EventError("`tool_choice` must be auto or none (no tools here)", param=f"{where}.tool_choice")
        if "instructions" in given:
            if given["instructions"] is not None and not isinstance(given["instructions"], str):
                raise EventError("`instructions` must be a string", param=f"{where}.instructions")
            config["instructions"] = given["instructions"]
        if "output_modalities" in given:
            config["output_modalities"] = self._modalities(given["output_modalities"], f"{where}.output_modalities")
        if "max_output_tokens" in given:
            config["max_output_tokens"] = events.max_tokens(given["max_output_tokens"], f"{where}.max_output_tokens")
        if "temperature" in given:
            config["temperature"] = events.temperature(given["temperature"], f"{where}.temperature")
        if "truncation" in given and where == "session":
            if given["truncation"] not in ("auto", "disabled"):
                raise EventError('`truncation` must be "auto" or "disabled"', param="session.truncation")
            config["truncation"] = given["truncation"]
        sound = {} if given.get("audio") is None else given["audio"]
        if not isinstance(sound, dict) or not all(isinstance({} if sound.get(k) is None else sound[k], dict)
                                                  for k in ("input", "output")):
            raise EventError("`audio` must be an object of objects", param=f"{where}.audio")
        voice = (sound.get("output") or {}).get("voice")
        if voice is not None:
            config["voice"] = self._voice(voice, f"{where}.audio.output.voice")
        return config

    def _transcription(self, value: Any) -> dict[str, Any] | None:
        param = "session.audio.input.transcription"
        if value is None:
            return None
        events.only(value, {"model", "language", "prompt"}, param)
        if not isinstance(value, dict) or any(not isinstance(value.get(k), (str, type(None)))
                                              for k in ("model", "language", "prompt")):
            raise EventError("`transcription` is null or {model, language, prompt} (strings; the served model "
                             "transcribes, whichever `model` is named)", param=param)
        if self.transcription_turn is None:
            raise EventError(f"model `{self.model}` has no text output to transcribe with", param=param)
        try:
            self.transcription_turn(value.get("language"), value.get("prompt"))
        except ValueError as e:  # (a language it does not know)
            raise EventError(str(e), param=f"{param}.language") from None
        return {"model": value.get("model") or self.model, "language": value.get("language") or None,
                "prompt": value.get("prompt") or None}

    def _transcribe(self, item_id: str) -> None:
        """Transcribe a user audio item in the background when the session asks for it."""
        if self.config["transcription"] is not None and not self.closed:
            self.transcribing[item_id] = asyncio.create_task(
                self._transcript(item_id, self.audio_of[item_id], self.config["transcription"]))

    def _read_ahead(self, also_latest: bool, ids: list[str] | None = None) -> None:
        """Without input transcription, audio items past what a prompt hears are read by transcripts
        the session makes for itself, unannounced: those not made yet are started (`also_latest`:
        the latest audio items too, which the next audio item pushes past; started after a
        response, while the user listens)."""
        if self.audio_cap is None or self.transcription_turn is None or self.closed:
            return
        if ids is None:
            ids = self._audio_items() if also_latest else self._read_items()
        quiet = {"model": self.model, "language": None, "prompt": None}
        for item_id in ids:
            if item_id not in self.transcribing and self._words(item_id) is None:
                self.transcribing[item_id] = asyncio.create_task(
                    self._transcript(item_id, self.audio_of[item_id], quiet, announce=False))

    def _words(self, item_id: str) -> str | None:
        """A user audio item's transcript: the client's or input transcription's, else the session's own."""
        item = next((i for i in self.items if i["id"] == item_id), None)
        said = events.transcript_of(item) if item is not None else None
        return said if said is not None else self.read_as.get(item_id)

    async def _transcript(self, item_id: str, pcm: bytes, config: dict[str, Any], announce: bool = True) -> None:
        audio_part = {"type": "input_audio", "input_audio": {"data": encode.wav_b64(pcm), "format": "wav"}}
        turn = self.transcription_turn(config["language"], config["prompt"])
        messages = [{**m, "content": [audio_part if p.get("type") == "audio" else p for p in m["content"]]}
                    if isinstance(m["content"], list) else m for m in turn]
        async with self.transcribers:
            await self._transcribe_now(item_id, messages, announce)

    async def _transcribe_now(self, item_id: str, messages: list[dict], announce: bool) -> None:
        body = {"model": self.model, "messages": messages, "modalities": ["text"], "temperature": 0, "stream": True}
        scored = announce and events.LOGPROBS in (self.config["include"] or [])
        if scored:
            body["logprobs"] = True
        item = next((i for i in self.items if i["id"] == item_id), None)
        at = next((k for k, p in enumerate(item["content"]) if p["type"] == "input_audio"), 0) if item else 0
        where = {"item_id": item_id, "content_index": at}
        try:
            run = await self.start_chat(body)
            try:
                pieces, scores = [], []
                async for kind, value in run.stream_from(await run.first()):
                    if kind == "text" and value:
                        pieces.append(value)
                        new = [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes}
                               for e in (run.logprobs or [])[len(scores):]] if scored else None
                        scores += new or []
                        if announce:
                            await self.send("conversation.item.input_audio_transcription.delta", **where, delta=value,
                                            **({"logprobs": new} if scored else {}))
            except BaseException:
                await run.abort()
                raise
        except APIError as e:
            if self.transcribing.get(item_id) is asyncio.current_task():
                del self.transcribing[item_id]  # (a later response or read-ahead tries again)
            if not announce:
                log.info("realtime %s: reading item %s failed: %s", self.id, item_id, e.message)
                return
            await self.send("conversation.item.input_audio_transcription.failed", **where, error={
                "type": "server_error" if e.status >= 500 else "invalid_request_error", "code": e.code,
                "message": e.message, "param": None})
            return
        text = "".join(pieces)
        if not announce:
            self.read_as[item_id] = text
            return
        item = next((i for i in self.items if i["id"] == item_id), None)  # (unless deleted meanwhile)
        if item is not None:
            item["content"][at]["transcript"] = text
        if scored:  # (tokens with no text of their own yet: held back by the detokenizer until the end)
            scores += [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes} for e in run.logprobs[len(scores):]]
        await self.send("conversation.item.input_audio_transcription.completed", **where, transcript=text,
                        usage={"type": "tokens", "input_tokens": run.n_prompt, "output_tokens": run.completion_tokens,
                               "total_tokens": run.n_prompt + run.completion_tokens},
                        **({"logprobs": scores} if scored else {}))

    def _modalities(self, value: Any, param: str) -> list[str]:
        if value not in (["text"], ["audio"]):
            raise EventError('`output_modalities` must be ["audio"] (speech and its transcript) or ["text"]',
                             param=param)
        if value == ["audio"] and not self.has_audio:
            raise EventError(f"model `{self.model}` has no audio output", param=param)
        return list(value)

    def _voice(self, voice: Any, param: str) -> str:
        known = {v.lower(): v for v in self.voices}
        if not isinstance(voice, str) or voice.lower() not in known:
            raise EventError(f"unknown voice {voice!r}; available voices: {', '.join(self.voices)}", param=param)
        return known[voice.lower()]

    async def _append(self, event: dict) -> None:
        data = event.get("audio")
        if not isinstance(data, str):
            raise EventError("`audio` must be base64 audio in the session's input format", param="audio")
        try:
            pcm = base64.b64decode(data, validate=True)
        except ValueError:
            raise EventError("`audio` is not valid base64", param="audio") from None
        fmt = self.config["input_format"]
        if len(pcm) % 2 and fmt == encode.PCM:
            raise EventError("`audio` must hold whole PCM16 samples (an even number of bytes)", param="audio")
        grown = len(self.buffer) + len(pcm) * (1 if fmt == encode.PCM else 6)  # (G.711: 3 PCM16 samples a byte)
        if self.detector is None and grown > self.max_buffer_bytes:
            raise EventError(f"the input audio buffer would exceed {self.max_buffer_bytes // 2 / RATE:g} s "
                             "(`server.max_audio_seconds`); commit or clear it first", code="buffer_too_large",
                             param="audio")
        pcm = encode.heard(pcm, fmt, self.inbound)
        if self.detector is None:
            self.buffer += pcm
            return
        # In pieces that end a turn under way exactly at the longest item (whole samples).
        step, k = max(2, self.max_item_bytes // 8 * 2), 0
        while k < len(pcm):
            n = min(step, self.max_item_bytes - len(self.buffer)) if self.turn_item is not None else step
            await self._hear(pcm[k:k + n])
            k += n

    async def _hear(self, pcm: bytes) -> None:
        """Audio through turn detection: a turn's start and stop as events, its audio committed at the
        stop (with `prefix_padding_ms` before the start); outside a turn the buffer keeps only that padding."""
        vad = events.gate(self.config["turn_detection"])
        self.buffer += pcm
        for kind, at in self.detector.feed(pcm):
            ms = at * 1000 // RATE
            if kind == "started":
                # (after a turn cut at the buffer's size, the speech going on: all the audio since)
                pad = vad["prefix_padding_ms"] * RATE // 1000
                at = self.buffer_at if self.cut_short is not None else max(self.buffer_at, at - pad)
                self.cut_short = None
                del self.buffer[:(at - self.buffer_at) * 2]
                self.buffer_at, self.turn_item = at, events.new_id("item")
                self._disarm_idle()
                await self.send("input_audio_buffer.speech_started", audio_start_ms=at * 1000 // RATE,
                                item_id=self.turn_item)
                if vad["interrupt_response"] and self._responding() and self.reply.keep:
                    await self._cancel("turn_detected")
            elif self.turn_item is not None:
                await self.send("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=self.turn_item)
                await self._end_turn(at, vad)
        if self.turn_item is not None and len(self.buffer) >= self.max_item_bytes:  # (no stop in time)
            self.detector.end()
            # (the detector restarts a turn within its first two frames if the speech goes on)
            self.cut_short = self.buffer_at + len(self.buffer) // 2 + 3 * self.detector.frame
            at = self.buffer_at + self.max_item_bytes // 2
            await self.send("input_audio_buffer.speech_stopped", audio_end_ms=at * 1000 // RATE, item_id=self.turn_item)
            await self._end_turn(at, vad)
        if self.cut_short is not None and self.buffer_at + len(self.buffer) // 2 >= self.cut_short:
            self.cut_short = None  # (no speech after the cut: the silence since is trimmed as any)
        if self.turn_item is None and self.cut_short is None:
            # (the padding, and the frames the detector sees before it says a turn started)
            keep = (vad["prefix_padding_ms"] * RATE // 1000 + self.detector.lookback) * 2
            if len(self.buffer) > keep:
                self.buffer_at += (len(self.buffer) - keep) // 2
                del self.buffer[:len(self.buffer) - keep]

    async def _end_turn(self, at: int, vad: dict[str, Any]) -> None:
        """A detected turn's audio (up to sample `at`) committed; then a response, when asked for."""
        item_id, self.turn_item = self.turn_item, None
        cut = (at - self.buffer_at) * 2
        pcm, self.buffer, self.buffer_at = bytes(self.buffer[:cut]), self.buffer[cut:], at
        if len(pcm) < int(MIN_COMMIT_S * RATE) * 2:  # (a click with no padding before it: no turn to hear)
            log.info("realtime %s: a detected turn of %d ms dropped", self.id, len(pcm) * 500 // RATE)
            return
        try:
            self._check_length(len(pcm), "audio")
            await self._room_for(len(pcm))
            await self._add_audio(pcm, item_id)
            if vad["create_response"] and not self._responding() and not self.creating:
                await self._response_create({})
        except (EventError, APIError) as e:  # (said; the session and its audio go on)
            await self.error(e, None)
        if not self._responding() and not self.creating:
            self._arm_idle()

    # ---- server_vad's idle timeout -------------------------------------------------------------

    def _arm_idle(self) -> None:
        """With `idle_timeout_ms`, a response is made when the user says nothing for that long after
        the last response's audio has played (`played_until`: its response.done plus its length) or
        after their last turn. Speech, a response asked for, or new turn detection settings stop the
        timer (the last start it again, under the new settings)."""
        self._disarm_idle()
        vad = self.config["turn_detection"] and events.gate(self.config["turn_detection"])
        if self.closed or vad is None or vad["idle_timeout_ms"] is None or self.turn_item is not None:
            return
        playback_s = max(0.0, self.played_until - asyncio.get_running_loop().time())
        self.idle = asyncio.create_task(self._idle(playback_s, vad["idle_timeout_ms"] / 1000))

    def _disarm_idle(self) -> None:
        if self.idle is not None and self.idle is not asyncio.current_task():
            self.idle.cancel()
        self.idle = None

    def _heard_ms(self) -> int:
        return (self.buffer_at + len(self.buffer) // 2) * 1000 // RATE

    async def _idle(self, playback_s: float, timeout_s: float) -> None:
        await asyncio.sleep(playback_s)
        start_ms = self._heard_ms()
        await asyncio.sleep(timeout_s)
        if self._responding() or self.creating or self.turn_item is not None or self.closed:
            return
        # A response being made: a client's response.create meanwhile is refused, and speech (which
        # stops a timer) no longer stops this task; close() still does.
        self.creating, self.idle, self.making = True, None, asyncio.current_task()
        # What the buffer holds (in server_vad, outside a turn: the last prefix padding's worth; none
        # when the client sends no audio) is committed as the user's turn, at least 100 ms of it.
        least = int(MIN_COMMIT_S * RATE) * 2
        pcm = bytes(self.buffer)[-self.max_item_bytes:]
        pcm = bytes(least - len(pcm)) + pcm if len(pcm) < least else pcm
        self.buffer_at += len(self.buffer) // 2
        self.buffer, self.cut_short, item_id = bytearray(), None, events.new_id("item")
        try:
            await self.send("input_audio_buffer.timeout_triggered", audio_start_ms=start_ms,
                            audio_end_ms=self._heard_ms(), item_id=item_id)
            await self._room_for(len(pcm))
            await self._add_audio(pcm, item_id)
            await self._create({})
        except (EventError, APIError) as e:  # (said; the timer starts again after the next response or turn)
            await self.error(e, None)
        except Exception:  # (the server's fault: logged, the session goes on)
            log.exception("realtime %s: the idle timeout's response failed", self.id)
        finally:
            self.creating, self.making = False, None

    def _responding(self) -> bool:
        return self.response is not None and not self.response.done()

    async def _clear(self, event: dict) -> None:
        self.buffer_at += len(self.buffer) // 2
        self.buffer, self.turn_item, self.cut_short = bytearray(), None, None
        if self.detector is not None:
            self.detector.end()
        await self.send("input_audio_buffer.cleared")

    async def _commit(self, event: dict) -> None:
        if len(self.buffer) < int(MIN_COMMIT_S * RATE) * 2:
            raise EventError(f"the input audio buffer holds {len(self.buffer) // 2 / RATE * 1000:.0f} ms; a commit "
                             f"needs at least {MIN_COMMIT_S * 1000:.0f} ms", code="input_audio_buffer_commit_empty")
        self._check_length(len(self.buffer), "audio")
        await self._room_for(len(self.buffer))
        pcm, item_id = bytes(self.buffer), self.turn_item or events.new_id("item")  # (a turn under way: its id)
        self.buffer_at += len(self.buffer) // 2
        self.buffer, self.turn_item, self.cut_short = bytearray(), None, None
        if self.detector is not None:
            self.detector.end()
        await self._add_audio(pcm, item_id)

    def _check_length(self, n: int, param: str) -> None:
        """An audio item is at least 100 ms and at most what the model hears of a clip."""
        if n < int(MIN_COMMIT_S * RATE) * 2 or n > self.max_item_bytes:
            raise EventError(f"an audio item is {n // 2 / RATE:g} s; it must be {MIN_COMMIT_S * 1000:.0f} ms to "
                             f"{self.max_item_bytes // 2 / RATE:g} s (what this model hears of one clip, within "
                             "`server.max_audio_seconds`)", code="invalid_audio_length", param=param)

    async def _add_audio(self, pcm: bytes, item_id: str) -> None:
        """Committed audio as a user item at the conversation's end."""
        item = {"id": item_id, "type": "message", "object": "realtime.item", "status": "completed",
                "role": "user", "content": [{"type": "input_audio", "transcript": None}]}
        previous = self.items[-1]["id"] if self.items else None
        self.audio_of[item["id"]] = pcm
        self.items.append(item)
        await self.send("input_audio_buffer.committed", previous_item_id=previous, item_id=item["id"])
        await self.send("conversation.item.added", previous_item_id=previous, item=item)
        await self.send("conversation.item.done", previous_item_id=previous, item=item)
        self._transcribe(item["id"])

    async def _item_create(self, event: dict) -> None:
        item, pcm, images = await self._new_item(event.get("item"), "item")
        if len(images) > self.max_kept_images:  # (refused before anything gives way to it)
            raise EventError(f"an item holds at most {self.max_kept_images} images", param="item.content")
        item_id = item["id"]
        if any(i["id"] == item_id for i in self.items):
            raise EventError(f"an item with id {item_id!r} exists", param="item.id")
        after = event.get("previous_item_id")  # ("root": the conversation's start)
        if after not in (None, "root") and not any(i["id"] == after for i in self.items):
            raise EventError(f"no item {after!r} to insert after", code="item_not_found", param="previous_item_id")
        await self._room_for(len(pcm), spare=after)
        await self._room_for_images(len(images), spare=after)
        await self._room_for_items(spare=after)
        at = len(self.items) if after is None else 0 if after == "root" else \
            next(k for k, i in enumerate(self.items) if i["id"] == after) + 1
        previous = self.items[at - 1]["id"] if at else None
        self.items.insert(at, item)
        if images:
            self.images_of[item_id] = images
        if pcm:
            self.audio_of[item_id] = pcm
        await self.send("conversation.item.added", previous_item_id=previous, item=item)
        await self.send("conversation.item.done", previous_item_id=previous, item=item)
        if pcm and events.transcript_of(item) is None:
            self._transcribe(item_id)

    async def _new_item(self, given: Any, where: str) -> tuple[dict[str, Any], bytes, list[str]]:
        """A message item the client gives (`conversation.item.create`, `response.input`), checked:
        the item, its audio (PCM16, b"" if none) and its images (data URLs)."""
        if not isinstance(given, dict) or given.get("type", "message") != "message":
            raise EventError("only message items are supported (no function calls here)", param=f"{where}.type")
        events.only(given, {"id", "type", "object", "role", "content", "status"}, where)
        if given.get("status") not in (None, "completed"):
            raise EventError("a created item's `status` is completed", param=f"{where}.status")
        role = given.get("role")
        if role not in ("user", "assistant", "system"):
            raise EventError(f"`{where}.role` must be user, assistant or system", param=f"{where}.role")
        content = given.get("content")
        if not isinstance(content, list) or not content:
            raise EventError(f"`{where}.content` must be a non-empty list of parts", param=f"{where}.content")
        parts, pcm, images = [], None, []  # (one audio part an item: its transcript is the item's)
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) and isinstance(part.get("type"), str) else None
            param = f"{where}.content[{j}]"
            events.only(part, events.PART_FIELDS.get(kind, {"type"}), param)
            if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
                parts.append({"type": kind, "text": part["text"]})
            elif (kind == "input_audio" and role == "user" and isinstance(part.get("audio"), str) and pcm is None
                  and isinstance(part.get("transcript"), (str, type(None)))):
                try:
                    pcm = base64.b64decode(part["audio"], validate=True)
                except ValueError:
                    raise EventError("`audio` is not valid base64", param=f"{param}.audio") from None
                parts.append({"type": "input_audio", "transcript": part.get("transcript")})
            elif (kind == "input_image" and role == "user" and isinstance(part.get("image_url"), str)
                  and part.get("detail") in (None, "auto", "low", "high")):
                images.append(await self._image(part["image_url"], part.get("detail"), f"{param}.image_url"))
                parts.append({"type": "input_image", "detail": part.get("detail") or "auto"})
            elif kind == "output_audio" and role == "assistant" and isinstance(part.get("transcript"), str):
                parts.append({"type": "output_audio", "transcript": part["transcript"]})  # (read by its transcript)
            else:
                raise EventError(f"{param}: unsupported part {kind!r} (input_text; in a user item one input_audio: "
                                 "base64 `audio`, a string `transcript` if any, and input_image: a data: URL "
                                 "`image_url`, `detail` auto, low or high; in an assistant item output_text, "
                                 "or output_audio by its `transcript`)", param=param)
        if pcm is not None:
            fmt = self.config["input_format"]
            if len(pcm) % 2 and fmt == encode.PCM:
                raise EventError("an item's audio must be whole PCM16 samples (an even number of bytes)",
                                 param=f"{where}.content")
            pcm = encode.heard(pcm, fmt, encode.converter(fmt, up=True), last=True)  # (as 24 kHz PCM16)
            self._check_length(len(pcm), f"{where}.content")
        item_id = given.get("id") if isinstance(given.get("id"), str) and given["id"] else events.new_id("item")
        item = {"id": item_id, "type": "message", "object": "realtime.item", "status": "completed", "role": role,
                "content": parts}
        return item, pcm or b"", images

    async def _image(self, url: str, detail: str | None, param: str) -> str:
        """An input_image's data URL, checked as a chat's image is (format, bytes, pixels); with
        `detail: low`, the image within 512 x 512 (a PNG of it)."""
        if self.image_cap == 0:
            raise EventError(f"model `{self.model}` takes no images (stage 0's limit_mm_per_prompt)", param=param)
        max_bytes, max_pixels = self.image_limits
        try:
            rgb = await asyncio.to_thread(lambda: image.decode_image(image.image_data_url(url, max_bytes=max_bytes),
                                                                     max_pixels=max_pixels))
        except image.ImageError as e:
            raise EventError(f"{param}: {e}", param=param) from None
        if detail == "low" and max(rgb.shape[:2]) > encode.LOW_DETAIL:
            return await asyncio.to_thread(encode.low_detail, rgb)
        return url

    async def _room_for_images(self, more: int, spare: str | None = None) -> None:
        """Room for `more` images in what the conversation keeps: with truncation `auto` the oldest
        items holding images are deleted (conversation.item.deleted; not `spare`); `disabled`: an error."""
        kept = sum(map(len, self.images_of.values()))
        if kept + more <= self.max_kept_images:
            return
        if self.config["truncation"] == "disabled" or more > self.max_kept_images:
            raise EventError(f"the conversation would hold over {self.max_kept_images} images; delete earlier "
                             "items first (conversation.item.delete)", code="conversation_too_large")
        for item_id in [i["id"] for i in self.items if i["id"] in self.images_of and i["id"] != spare]:
            if kept + more <= self.max_kept_images:
                break
            kept -= len(self.images_of[item_id])
            await self._forget(item_id)

    async def _room_for(self, more: int, spare: str | None = None) -> None:
        """Room for `more` bytes of audio in what the conversation keeps: with truncation `auto` the
        oldest audio items give theirs up (a transcribed one stays as its transcript, one without is
        deleted: conversation.item.deleted; `spare` is not deleted); with `disabled`, an error."""
        kept = sum(len(a) for a in self.audio_of.values())
        if kept + more <= self.max_kept_bytes:
            return
        if self.config["truncation"] == "disabled" or more > self.max_kept_bytes:
            raise EventError(f"the conversation would hold over {self.max_kept_bytes // 2 / RATE:g} s of audio; "
                             "delete earlier items first (conversation.item.delete)", code="conversation_too_large")
        def pending(item_id: str) -> bool:  # (a transcript under way: its audio is needed until it is done)
            task = self.transcribing.get(item_id)
            return task is not None and not task.done()

        def read(item_id: str) -> bool:
            return self._words(item_id) is not None and not pending(item_id)

        # Transcribed items' audio first, then those no transcript is coming for, then those being transcribed.
        ids = self._audio_items()
        for item_id in ([i for i in ids if read(i)] + [i for i in ids if not read(i) and not pending(i)]
                        + [i for i in ids if not read(i) and pending(i)]):
            if kept + more <= self.max_kept_bytes:
                break
            kept -= len(self.audio_of[item_id])
            if read(item_id) or item_id == spare:  # (`spare` stays, without its audio)
                del self.audio_of[item_id]
            else:
                await self._forget(item_id)

    async def _room_for_items(self, spare: str | None = None) -> None:
        """Room for one more item (`_KEPT_ITEMS`): with truncation `auto` the oldest item is deleted
        (not `spare`, nor a reply under way); `disabled`: an error."""
        if len(self.items) < _KEPT_ITEMS:
            return
        if self.config["truncation"] == "disabled":
            raise EventError(f"the conversation holds {len(self.items)} items, its most; delete earlier items first "
                             "(conversation.item.delete)", code="conversation_too_large")
        old = next((i["id"] for i in self.items if i["id"] != spare and i["status"] != "in_progress"), None)
        if old is not None:
            await self._forget(old)

    async def _item_delete(self, event: dict) -> None:
        item_id = event.get("item_id")
        if not any(i["id"] == item_id for i in self.items):
            raise EventError(f"no item {item_id!r} in the conversation", code="item_not_found", param="item_id")
        await self._forget(item_id)

    def _shrunk(self, item_id: str, deleted: bool) -> None:
        """An item truncated or about to be deleted. Where it was in the last prompt, that prompt's
        room estimate is stale (an interrupted reply's unheard transcript, which the client cuts,
        makes most of it), so the next prompt starts where the last one did."""
        self.shrinks += 1
        ids = [i["id"] for i in self.items]
        if self.room_from in ids and item_id in ids and ids.index(item_id) >= ids.index(self.room_from):
            self.first_kept, self.room_from = self.room_from, None
        if deleted and item_id in ids and item_id in (self.first_kept, self.room_from):
            k = ids.index(item_id)  # (the item after it starts the prompt now; the last: the one before)
            after = ids[k + 1] if k + 1 < len(ids) else ids[k - 1] if k else None
            self.first_kept = after if item_id == self.first_kept else self.first_kept
            self.room_from = after if item_id == self.room_from else self.room_from

    async def _forget(self, item_id: str) -> None:
        self._shrunk(item_id, deleted=True)
        self.items = [i for i in self.items if i["id"] != item_id]
        self.audio_of.pop(item_id, None)
        self.images_of.pop(item_id, None)
        self.spoken_ms.pop(item_id, None)
        self.read_as.pop(item_id, None)
        task = self.transcribing.pop(item_id, None)
        if task is not None:
            task.cancel()
        await self.send("conversation.item.deleted", item_id=item_id)

    async def _item_retrieve(self, event: dict) -> None:
        item_id = event.get("item_id")
        item = next((i for i in self.items if i["id"] == item_id), None)
        if item is None:
            raise EventError(f"no item {item_id!r} in the conversation", code="item_not_found", param="item_id")
        if item_id in self.audio_of:  # (a user audio item comes back with its audio, as OpenAI's does: in the
            # session's input format now)
            fmt = self.config["input_format"]
            sent = encode.said(self.audio_of[item_id], fmt, encode.converter(fmt, up=False), last=True)
            item = {**item, "content": [{**p, "audio": base64.b64encode(sent).decode()}
                                        if p["type"] == "input_audio" else p for p in item["content"]]}
        if item_id in self.images_of:  # (and its images)
            urls = iter(self.images_of[item_id])
            item = {**item, "content": [{**p, "image_url": next(urls)} if p["type"] == "input_image" else p
                                        for p in item["content"]]}
        await self.send("conversation.item.retrieved", item=item)

    async def _item_truncate(self, event: dict) -> None:
        """The client played `audio_end_ms` of an assistant's spoken reply (it was cut off): the
        reply's transcript is cut to about as much, so later responses read what was heard. A reply
        still running (a barge-in as its audio plays) is cut when it ends, at most to what it sent."""
        item_id, end = event.get("item_id"), event.get("audio_end_ms")
        item = next((i for i in self.items if i["id"] == item_id), None)
        running = self._responding() and self.reply.spoken and item is not None and item is self.reply.entry
        if item is None or (item_id not in self.spoken_ms and not running):
            raise EventError(f"no spoken assistant item {item_id!r} in the conversation", code="item_not_found",
                             param="item_id")
        if event.get("content_index", 0) != 0:
            raise EventError("an assistant item has one content part (index 0)", param="content_index")
        total = self.reply.samples * 1000 // RATE if running else self.spoken_ms[item_id]
        if not isinstance(end, int) or isinstance(end, bool) or not 0 <= end <= total:
            raise EventError(f"`audio_end_ms` must be an integer from 0 to the item's {total} ms of audio"
                             + (" sent so far" if running else ""), param="audio_end_ms")
        if running:
            heard = self.reply.heard_ms
            self.reply.heard_ms = end if heard is None else min(heard, end)
        else:
            self.cut(item, end)
        await self.send("conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=end)

    def cut(self, item: dict[str, Any], end: int) -> None:
        """A spoken assistant item heard to `end` ms: its transcript cut to about as much (whole words)."""
        total = self.spoken_ms[item["id"]]
        part = item["content"][0]
        text = part["transcript"] or ""
        keep = len(text) if end >= total else round(len(text) * end / total) if total else 0
        part["transcript"] = text[:keep].rsplit(" ", 1)[0] if keep < len(text) else text
        if end < total:
            self._shrunk(item["id"], deleted=False)
        self.spoken_ms[item["id"]] = end

    async def _response_create(self, event: dict) -> None:
        if self._responding() or self.creating:
            raise EventError("a response is in progress; wait for its response.done or send response.cancel",
                             code="conversation_already_has_active_response")
        self.creating = True
        self._disarm_idle()
        try:
            await self._create(event)
        finally:
            self.creating = False
            if not self._responding():  # (refused: the user is idle again from now)
                self._arm_idle()

    async def _create(self, event: dict) -> None:
        """A response: its settings and prompt checked, its chat run started, streamed by a task."""
        given = event.get("response") or {}
        if not isinstance(given, dict):
            raise EventError("`response` must be an object", param="response")
        config = self._settings(given, "response")
        events.only(given, events.RESPONSE_FIELDS, "response")
        if given.get("prompt") is not None:
            raise EventError("stored prompts are not served: send `instructions`", param="response.prompt")
        metadata = given.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise EventError("`metadata` is up to 16 string pairs (keys up to 64 characters, values up to 512)",
                             param="response.metadata")
        events.only(given.get("audio") or {}, {"output"}, "response.audio")
        events.only((given.get("audio") or {}).get("output") or {}, {"format", "voice"}, "response.audio.output")
        fmt = ((given.get("audio") or {}).get("output") or {}).get("format")
        if fmt is not None:
            config["output_format"] = events.audio_format(fmt, "response.audio.output.format")
        conversation = given.get("conversation") or "auto"
        if conversation not in ("auto", "none"):
            raise EventError("`conversation` is auto (the reply joins the session's conversation) or none",
                             param="response.conversation")
        own = None if given.get("input") is None else await self._input(given["input"])
        if own is None and not any(i["role"] == "user" for i in self.items):
            raise EventError("the conversation has no user item yet: commit audio or create a user item first",
                             code="conversation_empty")
        if own is not None and not own.items and not config["instructions"]:
            raise EventError("an empty `input` leaves the prompt empty: give items or `instructions`",
                             param="response.input")
        images = sum(map(len, (self if own is None else own).images_of.values()))
        if self.config["truncation"] == "disabled" and self.image_cap is not None and images > self.image_cap:
            raise EventError(f"the {'conversation' if own is None else 'response input'} holds {images} images; this "
                             f"pipeline sees at most {self.image_cap} a prompt (stage 0's limit_mm_per_prompt): leave "
                             "earlier ones out, or set truncation auto to leave the oldest out", code="too_many_images")
        if own is None:
            self._read_ahead(also_latest=False)
        else:  # (conversation items the input refers to, past the cap: read by the session's own transcripts)
            self._read_ahead(also_latest=False, ids=[i for i in self._input_read(own) if i in self.audio_of])
        for item_id in (self._read_items() if own is None else self._input_read(own)):
            # (their transcripts stand for them: wait for those under way)
            task = self.transcribing.get(item_id)
            if task is not None:
                await asyncio.wait({task})
            item = next((i for i in (self.items if own is None else own.items) if i["id"] == item_id), None)
            if item is None:  # (deleted while its transcript was awaited: the prompt no longer holds it)
                continue
            if events.transcript_of(item) is None and self._words(item_id) is None:
                where, held = ("conversation", len(self._audio_items())) if own is None else \
                    ("response input", len(own.audio_of))
                fix = ("could not transcribe item {} to send it as text: delete it (conversation.item.delete) or send "
                       "its words as a text item" if own is None or item_id in self.audio_of
                       else "item {} has no `transcript` to send it as text")
                raise EventError(f"the {where} holds {held} audio items; this pipeline hears at most {self.audio_cap} "
                                 f"a prompt (stage 0's limit_mm_per_prompt) and {fix.format(item_id)}",
                                 code="too_many_audio_items")
        reply = Reply(self, config, keep=conversation == "auto", own=own)
        reply.metadata = metadata
        try:
            await reply.begin()  # (a refusal by the chat path is this event's error; nothing started)
        except APIError as e:  # (the chat's fields, as this event names them)
            if e.param == "messages" or (e.param or "").startswith("messages."):
                e.param = "response.input" if own is not None else None
            elif e.param == "max_tokens":
                e.param = "response.max_output_tokens"
            raise
        if reply.keep:
            reply.enter()
        self.reply, self.response = reply, asyncio.create_task(reply.stream())

    async def _input(self, given: Any) -> Context:
        """`response.input`: the items a response's prompt holds instead of the conversation's, each
        a message item (as conversation.item.create takes) or {"type": "item_reference", "id"} to one
        in the conversation; `[]`: none (the instructions alone)."""
        if not isinstance(given, list) or len(given) > 256:
            raise EventError("`input` is a list of up to 256 items", param="response.input")
        own = Context([], {}, {})
        for j, entry in enumerate(given):
            where = f"response.input[{j}]"
            if isinstance(entry, dict) and entry.get("type") == "item_reference":
                events.only(entry, {"type", "id"}, where)
                item = next((i for i in self.items if i["id"] == entry.get("id")), None)
                if item is None:
                    raise EventError(f"no item {entry.get('id')!r} in the conversation", code="item_not_found",
                                     param=f"{where}.id")
                pcm, images = self.audio_of.get(item["id"]), self.images_of.get(item["id"])
            else:
                item, pcm, images = await self._new_item(entry, where)
                if any(i["id"] == item["id"] for i in self.items):
                    raise EventError(f"item {item['id']!r} is in the conversation: refer to it with "
                                     '{"type": "item_reference", "id": ...}', param=f"{where}.id")
            if any(i["id"] == item["id"] for i in own.items):
                raise EventError(f"item {item['id']!r} is in `input` twice", param=f"{where}.id")
            own.items.append(item)
            if pcm:
                own.audio_of[item["id"]] = pcm
            if images:
                own.images_of[item["id"]] = images
        return own

    async def _response_cancel(self, event: dict) -> None:
        if not self._responding():
            raise EventError("no response is in progress", code="response_cancel_not_active")
        if event.get("response_id") not in (None, self.reply.id):
            raise EventError(f"response {event['response_id']!r} is not the one in progress ({self.reply.id})",
                             code="response_cancel_not_active", param="response_id")
        await self._cancel("client_cancelled")

    async def _cancel(self, reason: str, gone: bool = False) -> None:
        """Cancel the running response; `gone`: the socket is, so no events (its request is dropped either way)."""
        reply, task = self.reply, self.response
        reply.cancel_reason = reason
        if not reply.finishing:  # (its last events under way: they are sent whole, the reply as it ended)
            task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        if not reply.started:  # (cancelled before its first step: none of stream() ran)
            await reply.run.abort()
            if not gone:
                await reply.never_ran()

    # ---- the conversation as a chat --------------------------------------------------------

    def _audio_items(self) -> list[str]:
        return [i["id"] for i in self.items if i["id"] in self.audio_of]

    def _read_items(self) -> list[str]:
        """Audio items sent by their transcripts: all but the latest the pipeline hears a prompt."""
        ids = self._audio_items()
        return [] if self.audio_cap is None or len(ids) <= self.audio_cap else ids[:len(ids) - self.audio_cap]

    def _shown_images(self, c: Context, skip: int) -> set[tuple[str, int]]:
        """The images a prompt from item `skip` on holds: the latest stage 0 takes a prompt (the
        older are left out, as truncation leaves out old items), as (item id, index in the item)."""
        images = [(i["id"], k) for i in c.items[skip:] for k in range(len(c.images_of.get(i["id"], [])))]
        return set(images if self.image_cap is None else images[-self.image_cap:] if self.image_cap else [])

    def _context(self) -> Context:
        return Context(self.items, self.audio_of, self.images_of)

    def _input_read(self, c: Context) -> list[str]:
        """A response input's audio items past what the pipeline hears a prompt (the oldest): read by
        their transcripts (the part's, or the conversation's for a referenced item)."""
        ids = [i["id"] for i in c.items if i["id"] in c.audio_of]
        return [] if self.audio_cap is None or len(ids) <= self.audio_cap else ids[:len(ids) - self.audio_cap]

    def chat_body(self, config: dict[str, Any], skip: int = 0, given: Context | None = None) -> dict[str, Any]:
        """The conversation (or a response's own input, `given`) as a chat request, less its first
        `skip` items (the instructions stay)."""
        messages: list[dict[str, Any]] = []
        if config["instructions"]:
            messages.append({"role": "system", "content": config["instructions"]})
        c = given or self._context()
        read = set(self._read_items() if given is None else self._input_read(given))
        shown = self._shown_images(c, skip)
        for item in c.items[skip:]:
            if item["status"] == "in_progress":  # (a reply under way: not yet said)
                continue
            parts, urls = [], iter(enumerate(c.images_of.get(item["id"], [])))
            for part in item["content"]:
                if part["type"] == "input_image":
                    k, url = next(urls)
                    if (item["id"], k) in shown:
                        parts.append({"type": "image_url", "image_url": {"url": url}})
                elif part["type"] == "input_audio" and item["id"] in c.audio_of and item["id"] not in read:
                    parts.append({"type": "input_audio",
                                  "input_audio": {"data": encode.wav_b64(c.audio_of[item["id"]]), "format": "wav"}})
                elif part["type"] == "input_audio":  # (read: by its transcript)
                    said = events.transcript_of(item)
                    said = said if said is not None else self._words(item["id"])
                    parts.append({"type": "text", "text": said or ""})
                elif part.get("text") is not None or part.get("transcript") is not None:
                    parts.append({"type": "text", "text": part.get("text") or part.get("transcript") or ""})
            if item["role"] == "user":
                messages.append({"role": "user", "content": parts or [{"type": "text", "text": ""}]})
            else:  # (a system or assistant turn is text: an assistant's spoken reply by its transcript)
                messages.append({"role": item["role"], "content": "".join(p.get("text", "") for p in parts)})
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True}
        if config["output_modalities"] == ["audio"]:
            body |= {"modalities": ["text", "audio"], "audio": {"voice": config["voice"], "format": "pcm"}}
        else:
            body["modalities"] = ["text"]
        cap = config["max_output_tokens"]
        body["max_tokens"] = self.max_tokens_limit if cap == "inf" else cap
        if config["temperature"] is not None:
            body["temperature"] = config["temperature"]
        return body


_HANDLERS: dict[str, Callable[[Session, dict], Awaitable[None]]] = {
    "session.update": Session._session_update,
    "input_audio_buffer.append": Session._append,
    "input_audio_buffer.clear": Session._clear,
    "input_audio_buffer.commit": Session._commit,
    "conversation.item.create": Session._item_create,
    "conversation.item.delete": Session._item_delete,
    "conversation.item.truncate": Session._item_truncate,
    "conversation.item.retrieve": Session._item_retrieve,
    "response.create": Session._response_create,
    "response.cancel": Session._response_cancel,
}
# (a transcription session: audio in, its turns transcribed; no responses, no items of the client's)
_TRANSCRIPTION_HANDLERS = {k: v for k, v in _HANDLERS.items()
                           if k.startswith(("session.", "input_audio_buffer.")) or k in (
                               "conversation.item.delete", "conversation.item.retrieve")}

