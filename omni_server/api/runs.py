"""The api's side of pipeline requests: each one's outputs as OpenAI responses, whole or streamed
(chat completions with text and audio, legacy completions, speech, transcripts)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from omni_server.api import audio, completions, errors, tools, transcription
from omni_server.api.errors import APIError
from omni_server.api.protocol import (
    AudioDelta,
    AudioResponse,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionChoice,
    DeltaMessage,
    LegacyLogprobs,
    PromptTokensDetails,
    ResponseMessage,
    TextCompletion,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from omni_server.orchestrator.orchestrator import Orchestrator, RequestState

if TYPE_CHECKING:
    from omni_server.api.app import ServerState

log = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}
# How long a returned audio id is said to stay valid (nothing is stored server-side).
AUDIO_TTL_S = 3600


def _sse(payload: dict, named: bool = False) -> str:
    """One server-sent event; `named`: with an `event:` line of its type (the Responses API's form)."""
    return (f"event: {payload['type']}\n" if named else "") + f"data: {json.dumps(payload)}\n\n"


async def typed_events(events: AsyncIterator[dict], abort: Callable[[], Awaitable[None]],
                       named: bool = False) -> AsyncIterator[str]:
    """SSE of OpenAI's typed events (`{"type": ...}`): a failure becomes an `error` event (the status
    line is gone), and a client that leaves mid-stream has its request aborted. `named`: each
    event also has an `event:` line naming its type, as OpenAI's Responses stream does (clients
    that dispatch on it; the type in the data stays the one the SDKs read)."""
    finished = False
    try:
        async for event in events:
            yield _sse(event, named)
        finished = True
    except APIError as e:
        finished = True
        yield _sse({"type": "error", **errors.error_body(e.status, e.message)}, named)
    finally:
        if not finished:
            await abort()


def _usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _delta_error(delta) -> APIError:
    return APIError(delta.error_code if delta.error_code in (400, 503) else 500, delta.error, code=delta.error_type)


class _Pipelined:
    """One pipeline request seen from the api (`orch`, `req`), which it can drop."""

    orch: Orchestrator
    req: RequestState
    aborted = False

    @property
    def ended(self) -> bool:
        """No stage holds the request any more: it finished or failed (`done`), or was aborted here."""
        return self.req.done or self.aborted

    async def abort(self, outcome: str = "aborted") -> None:
        """Drop the request in every stage unless it ended. (Its sends do not wait, so this also
        runs in the clean-up of a cancelled stream.)"""
        if not self.ended:
            self.aborted = True
            await self.orch.abort(self.req.request_id, outcome=outcome)


class BodyCut(Exception):
    """A raw body that cannot go on after its status line went out: the response ends without its
    last chunk, so the client sees it incomplete (already logged; no traceback)."""


class SpeechStream(_Pipelined):
    """One /v1/audio/speech request's audio, encoded piece by piece as the audio stage sends it:
    as the raw body (`first` then `raw`) or as OpenAI's speech SSE events (`sse`)."""

    def __init__(self, state: ServerState, orch: Orchestrator, req, fmt: str, n_input: int, speed: float = 1.0):
        self.state, self.orch, self.req, self.fmt, self.speed = state, orch, req, fmt, speed
        self.n_input, self.n_output = n_input, 0
        self._pieces = self._encoded()

    async def _encoded(self) -> AsyncIterator[bytes]:
        encoder = None
        async for stage_id, delta in self.orch.deltas(self.req):
            if delta.error is not None:
                raise _delta_error(delta)
            if stage_id == self.state.audio_stage and "audio" in delta.tensors:
                if encoder is None:
                    encoder = audio.StreamEncoder(delta.sample_rate, self.fmt, self.speed)
                data = await asyncio.to_thread(encoder.push, delta.tensors["audio"])
                if delta.finished:
                    self.n_output = delta.num_prompt_tokens
                    data += await asyncio.to_thread(encoder.close)
                yield data
        if encoder is None:
            raise APIError(500, "the pipeline returned no audio")

    async def first(self) -> bytes:
        return await anext(self._pieces)

    async def raw(self, first: bytes) -> AsyncIterator[bytes]:
        finished = False
        try:
            if first:
                yield first
            async for data in self._pieces:
                if data:
                    yield data
            finished = True
        except APIError as e:
            # The status line went out with the first bytes: end the body short (the client sees an
            # incomplete response, not a complete file).
            finished = True
            log.warning("%s failed mid-stream: %s", self.req.request_id, e.message)
            raise BodyCut from None
        finally:
            if not finished:  # client went away
                await self.abort()

    def sse(self) -> AsyncIterator[str]:
        return typed_events(self._events(), self.abort)

    async def _events(self) -> AsyncIterator[dict]:
        async for data in self._pieces:
            if data:
                yield {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
        yield {"type": "speech.audio.done", "usage": {
            "input_tokens": self.n_input, "output_tokens": self.n_output, "total_tokens": self.n_input + self.n_output}}


class Run(_Pipelined):
    """One pipeline request's outputs (one chat choice, or a transcription), gathered or streamed."""

    def __init__(self, state: ServerState, orch: Orchestrator, req, body: ChatCompletionRequest,
                 prompt_ids: list[int], audio_format: str | None = None, index: int = 0):
        self.state, self.orch, self.req, self.body, self.index = state, orch, req, body, index
        # With audio out, the text is the audio's transcript (OpenAI's shape: content stays null).
        self.audio_format = audio_format
        self.prompt_ids = prompt_ids
        self.n_prompt = len(prompt_ids)
        self.n_cached = 0  # of the prompt, tokens stage 0's prefix cache spared
        self.token_ids: list[int] = []
        self.detok = state.text.detokenizer(body.stop)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.tokens: dict[int, list[int]] = {s.id: [] for s in state.cfg.stages if s.output == "tokens"}
        # The text tokens' log-probabilities (body.logprobs), and how many a stream has sent.
        self.logprobs: list[TokenLogprob] | None = [] if body.logprobs else None
        self.logprobs_sent = 0
        self.token_ids_sent = 0  # (`return_token_ids`: of token_ids, how many a stream has sent)
        # The reply's tool calls (api/tools.py), read from its text; None: no tools offered.
        mode = body.tool_mode() if state.text_stage is not None else None
        named = body.tool_choice.function.name if mode == "named" else None
        self.calls = None if mode is None else tools.Calls(mode, named)
        self.calls_sent = 0  # (a stream's calls so far: each one's index)
        self._stream = self._events()

    async def first(self) -> tuple[str, Any] | None:
        """The first event of `_events` (None: there was none), for `_streamed`."""
        return await anext(self._stream, None)

    async def _events(self) -> AsyncIterator[tuple[str, Any]]:
        """("text", piece) as text becomes available and ("audio", (waveform, rate)) per audio
        piece; sets finish_reason at the end."""
        text_stage = self.state.text_stage
        async for stage_id, delta in self.orch.deltas(self.req):
            if delta.error is not None:
                raise _delta_error(delta)
            if stage_id == 0 and delta.num_prompt_tokens:
                self.n_prompt = delta.num_prompt_tokens  # as the engine runs it: media count their tokens
                self.n_cached = max(self.n_cached, delta.num_cached_tokens)
            if stage_id == text_stage:
                if self.detok.stopped:
                    continue  # tokens the stage made before it heard of the stop string
                self.completion_tokens += len(delta.new_token_ids)
                self.token_ids.extend(delta.new_token_ids)
                if self.logprobs is not None:
                    self._add_logprobs(delta)
                piece = self.detok.push(delta.new_token_ids)
                if self.detok.stopped:
                    self.finish_reason = "stop"
                    yield "text", piece + self.detok.flush()
                    if self.req.pending == {text_stage}:
                        await self.abort(outcome="ok")  # done: the stop string came
                        return
                    # Later stages (speech) still finish, on the text up to the stop.
                    await self.orch.finish(self.req.request_id, text_stage, keep=self.detok.kept)
                    continue
                if delta.finished:
                    self.finish_reason = _FINISH.get(delta.finish_reason or "", "stop")
                    piece += self.detok.flush()
                    if self.body.stop:  # (whatever is pending: a held output must not stay behind)
                        # No stop string in it: the stage may send its output downstream (hold_output).
                        await self.orch.finish(self.req.request_id, text_stage, keep=-1)
                if piece:
                    yield "text", piece
            elif stage_id in self.tokens:
                self.tokens[stage_id].extend(delta.new_token_ids)
                if delta.finished and text_stage is None:
                    self.finish_reason = _FINISH.get(delta.finish_reason or "", "stop")
            elif stage_id == self.state.audio_stage and "audio" in delta.tensors:
                yield "audio", (delta.tensors["audio"], delta.sample_rate)

    def _add_logprobs(self, delta) -> None:
        top, text = self.body.top_logprobs or 0, self.state.text
        for ids, lps in zip(delta.logprob_token_ids, delta.logprobs):
            entries = [TopLogprob(token=text.token_text(i), logprob=lp, bytes=list(text.token_bytes(i)))
                       for i, lp in zip(ids[:top + 1], lps[:top + 1])]
            self.logprobs.append(TokenLogprob(**entries[0].model_dump(), top_logprobs=entries[1:]))

    def _new_logprobs(self) -> ChoiceLogprobs | None:
        """A stream's logprobs of the tokens since its last chunk with text."""
        if self.logprobs is None:
            return None
        new, self.logprobs_sent = self.logprobs[self.logprobs_sent:], len(self.logprobs)
        return ChoiceLogprobs(content=new)

    async def _audio(self, transcript: str, pieces: list[tuple[Any, int]]) -> AudioResponse:
        import torch

        if not pieces:
            raise APIError(500, "the pipeline returned no audio")
        wave = torch.cat([torch.as_tensor(w).reshape(-1) for w, _ in pieces])
        data = await asyncio.to_thread(audio.encode_audio, wave, pieces[0][1], self.audio_format)
        return AudioResponse(id=f"audio_{uuid.uuid4().hex}", data=base64.b64encode(data).decode(),
                             expires_at=int(time.time()) + AUDIO_TTL_S, transcript=transcript)

    def omni_outputs(self) -> dict[str, dict[str, Any]] | None:
        if not self.tokens:
            return None
        return {self.state.cfg.stage(i).name: {"token_ids": ids} for i, ids in self.tokens.items()}

    async def collect(self) -> Choice:
        texts, pieces = [], []
        async for kind, value in self._stream:
            (texts if kind == "text" else pieces).append(value)
        text = "".join(texts)
        content = text if self.state.text_stage is not None else None
        message = ResponseMessage(content=content)
        finish = self.finish_reason or "stop"
        if self.calls is not None:
            content, found = tools.Calls.split(self.calls.mode, text, self.calls.name)
            message = ResponseMessage(content=content, tool_calls=[ToolCall(**c) for c in found] or None)
            finish = "tool_calls" if found else finish
        if self.audio_format is not None:
            message = ResponseMessage(content=None, audio=await self._audio(text, pieces))
        return Choice(index=self.index, message=message, finish_reason=finish,
                      logprobs=None if self.logprobs is None else ChoiceLogprobs(content=self.logprobs),
                      token_ids=self.token_ids if self.body.return_token_ids else None)

    def _choice(self, delta: DeltaMessage, finish: str | None = None,
                logprobs: ChoiceLogprobs | None = None) -> ChunkChoice:
        return ChunkChoice(index=self.index, delta=delta, finish_reason=finish, logprobs=logprobs)

    def _text_choice(self, delta: DeltaMessage, finish: str | None = None,
                     logprobs: ChoiceLogprobs | None = None) -> ChunkChoice:
        """A chunk of text (or the finish): with `return_token_ids`, the tokens that arrived since
        the last such chunk (a held-back piece's tokens come with the text that shows them, or the
        finish)."""
        choice = self._choice(delta, finish, logprobs)
        if self.body.return_token_ids:
            choice.token_ids = self.token_ids[self.token_ids_sent:]
            self.token_ids_sent = len(self.token_ids)
        return choice

    def _audio_choice(self, audio_id: str, data: bytes, expires_at: int) -> ChunkChoice:
        return self._choice(DeltaMessage(audio=AudioDelta(id=audio_id, data=base64.b64encode(data).decode(),
                                                          expires_at=expires_at)))

    async def stream_from(self, first: tuple[str, Any] | None) -> AsyncIterator[tuple[str, Any]]:
        if first is not None:
            yield first
            async for event in self._stream:
                yield event

    async def chunks(self, first: tuple[str, Any] | None) -> AsyncIterator[ChunkChoice]:
        """This choice's stream after `first` (the first event, from `first()`): its role, its text
        and audio as they come, its finish."""
        yield self._choice(DeltaMessage(role="assistant", content=""))
        # Audio goes out as it is made: transcript deltas and data deltas (the requested format,
        # encoded piece by piece; see audio.StreamEncoder) interleave, all under one audio id.
        audio_id, encoder = f"audio_{uuid.uuid4().hex}", None
        expires_at = int(time.time()) + AUDIO_TTL_S
        async for kind, value in self.stream_from(first):
            if kind == "text" and self.calls is not None:
                for choice in self._tool_items(self.calls.feed(value)):
                    yield choice
            elif kind == "text" and self.audio_format is None:
                yield self._text_choice(DeltaMessage(content=value), logprobs=self._new_logprobs())
            elif kind == "text":
                yield self._text_choice(DeltaMessage(audio=AudioDelta(id=audio_id, transcript=value)),
                                        logprobs=self._new_logprobs())
            else:
                wave, rate = value
                if encoder is None:
                    encoder = audio.StreamEncoder(rate, self.audio_format)
                data = await asyncio.to_thread(encoder.push, wave)
                if data:
                    yield self._audio_choice(audio_id, data, expires_at)
        if self.audio_format is not None:
            if encoder is None:
                raise APIError(500, "the pipeline returned no audio")
            data = await asyncio.to_thread(encoder.close)
            if data:
                yield self._audio_choice(audio_id, data, expires_at)
        finish = self.finish_reason or "stop"
        if self.calls is not None:
            for choice in self._tool_items(self.calls.close()):
                yield choice
            finish = "tool_calls" if self.calls.count else finish
        rest = self._new_logprobs()  # (tokens whose text was held back or empty)
        yield self._text_choice(DeltaMessage(), finish=finish,
                                logprobs=rest if rest is not None and rest.content else None)

    def _tool_items(self, items: list[tuple[str, Any]]) -> list[ChunkChoice]:
        """Chunks of content and calls read out of the text (tools.Calls); the tokens' logprobs and
        ids go with the first."""
        out = []
        for kind, value in items:
            if kind == "content":
                delta = DeltaMessage(content=value)
            else:
                self.calls_sent += 1
                delta = DeltaMessage(tool_calls=[ToolCallDelta(index=self.calls_sent - 1, **value)])
            out.append(self._text_choice(delta, logprobs=self._new_logprobs() if not out else None))
        return out


class Completion:
    """A chat completion: its n choices, each its own pipeline request (`Run`), gathered into one
    response or streamed as one SSE stream. Every request ends (finished or aborted) whatever
    happens: a choice that fails, a client that leaves, a cancellation."""

    def __init__(self, completion_id: str, runs: list[Run]):
        self.id, self.runs = completion_id, runs
        self.state, self.body = runs[0].state, runs[0].body
        self.created = int(time.time())

    async def abort(self) -> None:
        for run in self.runs:
            await run.abort()

    async def _each(self, work: Callable[[Run], Awaitable[Any]]) -> list[Any]:
        """`work(run)` for every choice at once; when one fails (or this is cancelled) the others
        stop and every request that has not ended is aborted."""
        tasks = [asyncio.ensure_future(work(run)) for run in self.runs]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await self.abort()
            raise

    async def first(self) -> list[tuple[str, Any] | None]:
        return await self._each(Run.first)

    def _usage(self) -> Usage:
        # OpenAI's count: the prompt once (every choice reads the same), the completions summed.
        prompt, completion = self.runs[0].n_prompt, sum(run.completion_tokens for run in self.runs)
        return _usage(prompt, completion, self.runs[0].n_cached)

    async def collect(self) -> ChatCompletion:
        choices = await self._each(Run.collect)
        omni = [run.omni_outputs() for run in self.runs]
        if len(choices) > 1:  # each choice's own, under it
            for choice, outputs in zip(choices, omni):
                choice.omni_outputs = outputs
        return ChatCompletion(id=self.id, created=self.created, model=self.state.cfg.model, choices=choices,
                              usage=self._usage(), omni_outputs=omni[0] if len(choices) == 1 else None,
                              prompt_token_ids=self.runs[0].prompt_ids if self.body.return_token_ids else None)

    def _chunk(self, choices: list[ChunkChoice], **extra) -> str:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.state.cfg.model, choices=choices,
                                    **extra)
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    async def sse(self, firsts: list[tuple[str, Any] | None]) -> AsyncIterator[str]:
        """The choices' streams after their first events (`first()`), merged as their chunks come;
        each choice's finish chunk carries its `omni_outputs`; then the usage of all."""
        try:
            async with aclosing(_merged([run.chunks(first) for run, first in zip(self.runs, firsts)])) as choices:
                async for choice in choices:
                    omni = self.runs[choice.index].omni_outputs() if choice.finish_reason else None
                    prompt = self.runs[0].prompt_ids if (self.body.return_token_ids and choice.index == 0
                                                         and choice.delta.role) else None
                    if chunk := self._chunk([choice], omni_outputs=omni, prompt_token_ids=prompt):
                        yield chunk
            opts = self.body.stream_options
            if opts is not None and opts.include_usage:
                yield self._chunk([], usage=self._usage())
        except APIError as e:
            yield _sse(errors.error_body(e.status, e.message))
        finally:
            await self.abort()  # (the client went away mid-stream, or a choice failed: the others)
        yield "data: [DONE]\n\n"


class TextCompletionRun(Completion):
    """A legacy text completion (`/v1/completions`): its prompts x n choices (`Run` k answers
    prompt k // n) as one response or stream in the legacy shape; `echoes[k]`: the text before
    choice k's own (its prompt's, with `echo`)."""

    def __init__(self, completion_id: str, runs: list[Run], echoes: list[str]):
        super().__init__(completion_id, runs)
        self.echoes = echoes
        # Where each choice's tokens start in its text, and how many of them have logprobs out.
        self.offsets = [self.state.text.offsets(len(e)) for e in echoes]
        self.done = [0] * len(runs)

    def _usage(self) -> Usage:
        # Each prompt counted once (not per choice), the completions summed.
        firsts = [run for run in self.runs if run.index % self.body.n == 0]
        completion = sum(run.completion_tokens for run in self.runs)
        return _usage(sum(run.n_prompt for run in firsts), completion, sum(run.n_cached for run in firsts))

    def _logprobs(self, index: int, logprobs: ChoiceLogprobs | None) -> LegacyLogprobs | None:
        if logprobs is None:
            return None
        entries, start = logprobs.content or [], self.done[index]
        self.done[index] += len(entries)
        return completions.legacy_logprobs(entries, self.runs[index].token_ids[start:start + len(entries)],
                                           self.offsets[index])

    async def collect(self) -> TextCompletion:
        choices = await self._each(Run.collect)
        return TextCompletion(
            id=self.id, created=self.created, model=self.state.cfg.model, usage=self._usage(),
            choices=[CompletionChoice(index=c.index, text=self.echoes[c.index] + (c.message.content or ""),
                                      logprobs=self._logprobs(c.index, c.logprobs), finish_reason=c.finish_reason,
                                      token_ids=c.token_ids) for c in choices])

    def _chunk(self, choices: list[ChunkChoice], **extra) -> str:
        """The legacy chunk of a chat chunk (a choice's role chunk carries its echo, or nothing)."""
        if not choices:  # the usage chunk
            chunk = TextCompletion(id=self.id, created=self.created, model=self.state.cfg.model, choices=[],
                                   usage=extra.get("usage"))
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        [c] = choices
        text = self.echoes[c.index] if c.delta.role else c.delta.content or ""
        if not text and c.finish_reason is None and c.logprobs is None and not c.token_ids:
            return ""
        choice = CompletionChoice(index=c.index, text=text, logprobs=self._logprobs(c.index, c.logprobs),
                                  finish_reason=c.finish_reason, token_ids=c.token_ids)
        chunk = TextCompletion(id=self.id, created=self.created, model=self.state.cfg.model, choices=[choice])
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


async def _merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of `streams` as they come (each stream's in its order), each stream's first item
    first, in the streams' order, and items ready together in that order too (the openai client
    places choices by the order their first chunks come: index 0 must lead). A failure in one ends
    all; those still running are cancelled when this ends early."""
    order = {id(it): k for k, it in enumerate(streams)}
    pending: dict[asyncio.Future, AsyncIterator[Any]] = {}
    try:
        for it in streams:
            try:
                item = await anext(it)
            except StopAsyncIteration:
                continue
            yield item
            pending[asyncio.ensure_future(anext(it))] = it
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: order[id(pending[t])]):
                it = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(it))] = it
                yield item
    finally:
        for task in pending:
            task.cancel()
        asyncio.gather(*pending, return_exceptions=True)  # (reads their outcomes: no "never retrieved" logs)


class Transcript(Completion):
    """A transcription or translation: the file's clips (transcription.pieces), each its own
    pipeline request run at once, their texts in order, joined by a space."""

    async def text(self) -> str:
        return " ".join(c.message.content for c in await self._each(Run.collect) if c.message.content)

    def usage(self) -> dict[str, Any]:
        return transcription.usage(sum(run.n_prompt for run in self.runs),
                                   sum(run.completion_tokens for run in self.runs))

    def sse(self, firsts: list[tuple[str, Any] | None]) -> AsyncIterator[str]:
        """OpenAI's `transcript.text.delta` events, clip after clip, then `transcript.text.done` with
        the whole text and the usage."""
        return typed_events(self._events(firsts), self.abort)

    async def _events(self, firsts: list[tuple[str, Any] | None]) -> AsyncIterator[dict]:
        said = ""
        for run, first in zip(self.runs, firsts):
            gap = " " if said else ""  # (between clips, as `text` joins them)
            async for _, piece in run.stream_from(first):
                if piece:
                    piece, gap = gap + piece, ""
                    said += piece
                    yield {"type": "transcript.text.delta", "delta": piece}
        yield {"type": "transcript.text.done", "text": said, "usage": self.usage()}
