"""A Realtime session (api/realtime.py) on its own: events in, events out, chat requests faked
(no pipeline), for what the e2e tests cannot reach in reasonable time: long turns, a long
conversation's audio."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np

from omni_server.api.realtime import Session

RATE = 24000


def _tone(seconds: float, dbfs: float = -20) -> np.ndarray:
    rms = 32768 * 10 ** (dbfs / 20)
    return (rms * np.sqrt(2) * np.sin(2 * np.pi * 300 * np.arange(int(seconds * RATE)) / RATE)).astype("<i2")


def _quiet(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype="<i2")


def _session(sent: list, max_buffer_s: float = 1.0) -> Session:
    async def send(event):
        sent.append(event)

    async def no_chat(body):
        raise AssertionError("no response asked for")

    return Session("m", send, no_chat, voices=[], has_audio=False, max_buffer_s=max_buffer_s, audio_cap=None)


async def _event(s: Session, **event) -> None:
    await s.receive(json.dumps(event))


def _b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.tobytes()).decode()


def test_a_turn_longer_than_the_buffer_is_committed_at_the_buffers_length():
    """server_vad without responses: 2.5 s of speech against a 1 s buffer is committed as 1 s
    turns (the speech going on opens the next, nothing lost); silence outside a turn is not kept
    beyond the prefix padding, however long it runs."""
    sent: list = []
    s = _session(sent)

    async def talk():
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": {
            "type": "server_vad", "create_response": False, "prefix_padding_ms": 100}}}})
        for piece in (_quiet(5.0), _tone(2.5), _quiet(0.6)):
            await _event(s, type="input_audio_buffer.append", audio=_b64(piece))

    asyncio.run(talk())
    assert not [e for e in sent if e["type"] == "error"], sent
    kinds = [e["type"] for e in sent if e["type"].startswith("input_audio_buffer.")]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed"] * 3
    lengths = [len(s.audio_of[i["id"]]) // 2 for i in s.items]
    # (4.9 s to 5.9 s, 5.9 to 6.9, then 6.9 s to the stop at 7.5 + 0.5 s)
    assert lengths == [RATE, RATE, int(1.1 * RATE)], lengths
    assert len(s.buffer) == 2 * int(0.1 * RATE)  # (after the last turn: 0.1 s of its silence, as padding)


def test_past_what_a_session_keeps_the_oldest_audio_gives_way():
    """A 1 s buffer keeps 4 s of audio a conversation. Truncation auto (the default): a fifth 1 s
    turn makes the oldest audio item give way: deleted when it has no transcript, kept as its
    transcript when it has one. Truncation disabled: an error, nothing dropped."""
    sent: list = []
    s = _session(sent)

    async def talk():
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": None}}})
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": _b64(_tone(1.0)), "transcript": "hello there"}]})
        for _ in range(4):
            await _event(s, type="input_audio_buffer.append", audio=_b64(_tone(1.0)))
            await _event(s, type="input_audio_buffer.commit")
        first, second = s.items[0], s.items[1]
        assert first["id"] not in s.audio_of and first in s.items  # (gave its audio up at the fourth commit)
        await _event(s, type="session.update", session={"truncation": "disabled"})
        await _event(s, type="input_audio_buffer.append", audio=_b64(_tone(1.0)))
        await _event(s, type="input_audio_buffer.commit")
        assert second["id"] in s.audio_of and len(s.buffer) == 2 * RATE  # (refused: nothing dropped)
        await _event(s, type="session.update", session={"truncation": "auto"})
        await _event(s, type="input_audio_buffer.commit")
        return first, second

    first, second = asyncio.run(talk())
    assert [e["error"]["code"] for e in sent if e["type"] == "error"] == ["conversation_too_large"]
    assert [e["item_id"] for e in sent if e["type"] == "conversation.item.deleted"] == [second["id"]]
    assert second not in s.items and sum(len(a) for a in s.audio_of.values()) == 4 * 2 * RATE
    body = s.chat_body(s.config)
    assert body["messages"][0]["content"] == [{"type": "text", "text": "hello there"}]
    assert len(body["messages"]) == 5 and all(m["content"][0]["type"] == "input_audio" for m in body["messages"][1:])


def test_an_item_is_retrieved_with_its_audio():
    sent: list = []
    s = _session(sent)
    pcm = _tone(0.5)

    async def talk():
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": None}}})
        await _event(s, type="input_audio_buffer.append", audio=_b64(pcm))
        await _event(s, type="input_audio_buffer.commit")
        await _event(s, type="conversation.item.retrieve", item_id=s.items[0]["id"])
        await _event(s, type="conversation.item.retrieve", item_id="item_nope")

    asyncio.run(talk())
    got = next(e for e in sent if e["type"] == "conversation.item.retrieved")["item"]
    assert got["id"] == s.items[0]["id"] and base64.b64decode(got["content"][0]["audio"]) == pcm.tobytes()
    assert "audio" not in s.items[0]["content"][0]  # (the conversation's own item is not grown by it)
    assert [e["error"]["code"] for e in sent if e["type"] == "error"] == ["item_not_found"]
