"""One Realtime response: a chat run streamed back as the API's events, and the prompt it reads."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from omni_server.api.errors import APIError
from omni_server.api.realtime import encode, events
from omni_server.api.realtime.encode import RATE
from omni_server.api.stretch import TimeStretch

if TYPE_CHECKING:
    from omni_server.api.realtime.session import Session

log = logging.getLogger(__name__)


class Context(NamedTuple):
    """What a response's prompt is made of: its items, their audio (PCM16) and images (data URLs)."""
    items: list[dict[str, Any]]
    audio_of: dict[str, bytes]
    images_of: dict[str, list[str]]


class Reply:
    """One response: a chat run streamed as Realtime events; added to the conversation when `keep`."""

    def __init__(self, session: Session, config: dict[str, Any], keep: bool, own: Context | None = None):
        self.s, self.config, self.keep = session, config, keep
        self.own = own  # (the response's own input: its prompt instead of the conversation)
        self.id, self.item_id = events.new_id("resp"), events.new_id("item")
        self.spoken = config["output_modalities"] == ["audio"]
        # The output speed: a time-stretch of the 24 kHz audio as it streams (a speed changed while
        # this reply runs applies from the next, as OpenAI's does).
        self.stretch = TimeStretch(RATE, config["speed"]) if self.spoken and config["speed"] != 1 else None
        # ... then in the client's format (a telephone one: down to 8 kHz as it streams)
        self.fmt = config["output_format"]
        self.outbound = encode.converter(self.fmt, up=False)
        self.run = None
        self.text: list[str] = []
        self.samples = 0  # (24 kHz samples sent)
        self.status = "in_progress"
        self.cancel_reason = "client_cancelled"
        self.started = False  # (stream() ran its first step)
        self.finishing = False  # (its last events are being sent: a cancel then waits for them instead)
        self.metadata: dict[str, str] | None = None  # (the client's, given back in the response)
        self.previous: str | None = None  # (the item the reply follows in the conversation)
        self.entry: dict[str, Any] | None = None  # (its item in the conversation while it runs, then its final form)
        self.shrinks = session.shrinks  # (the conversation's truncates and deletes before its prompt)
        self.heard_ms: int | None = None  # (a truncate while it ran: its item is cut there when it ends)

    def _item(self, status: str) -> dict[str, Any]:
        text = "".join(self.text)
        part = {"type": "output_audio", "transcript": text} if self.spoken else {"type": "output_text", "text": text}
        return {"id": self.item_id, "type": "message", "object": "realtime.item", "status": status,
                "role": "assistant", "content": [part] if status != "in_progress" else []}

    def _response(self, status: str, details: dict | None = None) -> dict[str, Any]:
        done = status != "in_progress"
        usage = None
        if done and self.run is not None:
            n_in, n_out = self.run.n_prompt, self.run.completion_tokens
            usage = {"total_tokens": n_in + n_out, "input_tokens": n_in, "output_tokens": n_out,
                     "input_token_details": {"cached_tokens": self.run.n_cached},
                     "output_token_details": {"text_tokens": n_out, "audio_tokens": 0}}
        return {"id": self.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": [self._item(self.status if done else "in_progress")] if done else [],
                "output_modalities": self.config["output_modalities"],
                "max_output_tokens": self.config["max_output_tokens"],
                "conversation_id": self.s.id if self.keep else None, "metadata": self.metadata,
                "audio": {"output": {"format": encode.FORMATS[self.fmt], "voice": self.config["voice"]}},
                "usage": usage}

    async def begin(self) -> None:
        """Start the chat run (its checks refuse here, before any response event). With truncation
        `auto`, a prompt over the context leaves out the conversation's oldest items, one more a try
        (from where the last response settled), down to the latest user item."""
        s = self.s
        kept = next((k for k, i in enumerate(s.items) if i["id"] == s.first_kept), 0)
        self.skip = min(kept, self._latest_user()) if s.config["truncation"] == "auto" and self.own is None else 0
        await self._start()

    def enter(self) -> None:
        """The reply's item joins the conversation as it starts (in progress: a prompt leaves it out),
        so items the client adds meanwhile come after it, and it can be retrieved or deleted."""
        s = self.s
        self.previous = s.items[-1]["id"] if s.items else None
        self.entry = self._item("in_progress")
        s.items.append(self.entry)

    def _latest_user(self) -> int:
        return max(k for k, i in enumerate(self.s.items) if i["role"] == "user")

    def _can_skip(self, e: APIError) -> bool:
        return (e.code == "context_length_exceeded" and self.s.config["truncation"] == "auto"
                and self.own is None and self.skip < self._latest_user())

    async def _start(self) -> None:
        s = self.s
        while True:
            try:
                self.run = await s.start_chat(s.chat_body(self.config, self.skip, self.own))
                break
            except APIError as e:
                if not self._can_skip(e):
                    raise
                self.skip += 1
        if self.own is None:
            s.first_kept, s.room_from = s.items[self.skip]["id"], None

    async def _first(self):
        """The run's first output. The api counts a media item as one token, the stage as its
        tokens: a prompt the stage finds over the context is truncated here as in `begin`."""
        while True:
            try:
                return await self.run.first()
            except APIError as e:
                if not self._can_skip(e):
                    raise
                await self.run.abort()
                self.skip += 1
                await self._start()

    def _leave_room(self) -> None:
        """Truncation `auto` drops items only when a prompt does not fit; a reply then has little room.
        When this one left less than a reply's worth (max_output_tokens, at most a quarter of the
        context), the next response starts that many prompt tokens later, by this prompt's mean
        tokens an item."""
        s, ctx = self.s, self.s.context
        if (not ctx or s.config["truncation"] != "auto" or self.run is None or not self.run.n_prompt
                or self.own is not None or s.shrinks != self.shrinks):  # (shrunk since: its size is stale)
            return
        cap = self.config["max_output_tokens"]
        want = min(ctx // 4, cap if isinstance(cap, int) else ctx)
        short = want - (ctx - self.run.n_prompt - self.run.completion_tokens)
        if short <= 0 or s.first_kept is None:
            return
        at = next((k for k, i in enumerate(s.items) if i["id"] == s.first_kept), None)
        if at is None:
            return
        end = next((k for k, i in enumerate(s.items) if i is self.entry), len(s.items) - 1)
        per_item = self.run.n_prompt / max(1, end - at)  # (the prompt held items at.. before this reply)
        ahead = min(at + -(-short // max(1.0, per_item)), len(s.items) - 1)
        s.room_from, s.first_kept = s.first_kept, s.items[int(ahead)]["id"]

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}

    async def _open(self) -> None:
        s, previous = self.s, self.previous
        await s.send("response.created", response=self._response("in_progress"))
        await s.send("response.output_item.added", response_id=self.id, output_index=0, item=self._item("in_progress"))
        if self.keep:
            await s.send("conversation.item.added", previous_item_id=previous, item=self._item("in_progress"))
        part = {"type": "audio", "transcript": ""} if self.spoken else {"type": "text", "text": ""}
        await s.send("response.content_part.added", part=part, **self._where())

    async def never_ran(self) -> None:
        """The events of a response cancelled before its task's first step (its request already dropped)."""
        await self._open()
        await self._finish("cancelled", {"type": "cancelled", "reason": self.cancel_reason}, self._where())

    async def stream(self) -> None:
        self.started = True
        s, where = self.s, self._where()
        status, details = "completed", None
        try:
            await self._open()
            first = await self._first()
            async for kind, value in self.run.stream_from(first):
                if kind == "text":
                    self.text.append(value)
                    name = "response.output_audio_transcript.delta" if self.spoken else "response.output_text.delta"
                    await s.send(name, delta=value, **where)
                elif self.spoken:
                    wave_piece, rate = value
                    await self._audio(await asyncio.to_thread(encode.pcm16, wave_piece, rate, self.stretch))
            if self.stretch is not None:  # (the stretch's last frames)
                await self._audio(encode.pcm16(self.stretch.flush(), RATE))
            if self.spoken and self.outbound is not None:  # (the conversion's last samples)
                await self._audio(b"", last=True)
            if self.run.finish_reason == "length":
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            self.finishing = True
            await self.run.abort()
            status, details = "cancelled", {"type": "cancelled", "reason": self.cancel_reason}
            await self._finish(status, details, where)
            raise
        except APIError as e:
            self.finishing = True
            await self.run.abort()
            status, details = "failed", {"type": "failed", "error": {"type": "server_error" if e.status >= 500
                                                                      else "invalid_request_error",
                                                                      "code": e.code, "message": e.message}}
        except Exception as e:  # (the server's fault: said, and the session goes on)
            log.exception("realtime response %s failed", self.id)
            self.finishing = True
            await self.run.abort()
            status, details = "failed", {"type": "failed", "error": {"type": "server_error", "code": None,
                                                                      "message": f"{type(e).__name__}"}}
        self.finishing = True
        await self._finish(status, details, where)

    async def _audio(self, pcm: bytes, last: bool = False) -> None:
        """24 kHz PCM16 of the reply, sent in the client's format."""
        self.samples += len(pcm) // 2
        out = encode.said(pcm, self.fmt, self.outbound, last=last)
        if out:
            await self.s.send("response.output_audio.delta", delta=base64.b64encode(out).decode(), **self._where())

    async def _finish(self, status: str, details: dict | None, where: dict) -> None:
        s, text = self.s, "".join(self.text)
        self.status = "completed" if status == "completed" else "incomplete"
        if self.spoken:
            if status in ("completed", "incomplete"):
                await s.send("response.output_audio.done", **where)
            await s.send("response.output_audio_transcript.done", transcript=text, **where)
            await s.send("response.content_part.done", part={"type": "audio", "transcript": text}, **where)
        else:
            await s.send("response.output_text.done", text=text, **where)
            await s.send("response.content_part.done", part={"type": "text", "text": text}, **where)
        item = self._item(self.status)
        await s.send("response.output_item.done", response_id=self.id, output_index=0, item=item)
        at = next((k for k, i in enumerate(s.items) if i is self.entry), None)  # (None: deleted meanwhile)
        if at is not None and status == "failed" and not text:  # (nothing said: no empty turn in the conversation)
            del s.items[at]
            await s.send("conversation.item.deleted", item_id=self.item_id)
        elif at is not None:
            self.entry.update(item)
            if self.spoken:
                s.spoken_ms[self.item_id] = self.samples * 1000 // RATE
                if self.heard_ms is not None:
                    s.cut(self.entry, self.heard_ms)
            await s.send("conversation.item.done", previous_item_id=s.items[at - 1]["id"] if at else None,
                         item=self.entry)
        await s.send("response.done", response=self._response(status, details))
        if self.keep and status != "failed":
            self._leave_room()
        if self.keep and s.audio_cap is not None and len(s._audio_items()) >= s.audio_cap:
            s._read_ahead(also_latest=True)  # (the next audio item pushes the latest past the cap)
        s.played_until = asyncio.get_running_loop().time() + self.samples / RATE
        s._arm_idle()

