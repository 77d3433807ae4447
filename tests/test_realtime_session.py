"""A Realtime session (api/realtime/) on its own: events in, events out, chat requests faked
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


async def _say(s: Session, text: str) -> None:
    """A user text item."""
    await _event(s, type="conversation.item.create", item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})


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
    # (4.9 s to 5.9 s, 5.9 to 6.9, 6.9 to 7.9: its stop would have come at 7.5 + 0.5 s)
    assert lengths == [RATE, RATE, RATE], lengths
    # (after the last turn: the padding and the detector's look-back of 3 frames)
    assert len(s.buffer) == 2 * int(0.16 * RATE)


def test_semantic_vad_ends_a_turn_after_the_silence_its_eagerness_sets():
    """semantic_vad (the Agents SDK's default) without a turn model: the level gate, a turn ending
    after 500 ms of silence at eagerness high, 800 at medium / auto, 1500 at low, its padding
    server_vad's 300 ms; the session shows the settings as given. A pause of 1 s ends a turn at
    high and auto but not at low, whose one turn then holds both stretches of speech."""
    def turns(eagerness: str | None) -> tuple[list[tuple[int, int]], dict, list[int]]:
        sent: list = []
        s = _session(sent, max_buffer_s=10.0)
        given = {"type": "semantic_vad", "create_response": False}
        if eagerness:
            given["eagerness"] = eagerness

        async def talk():
            await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": given}}})
            for piece in (_quiet(1.0), _tone(0.5), _quiet(1.0), _tone(0.5), _quiet(2.0)):
                await _event(s, type="input_audio_buffer.append", audio=_b64(piece))

        asyncio.run(talk())
        assert not [e for e in sent if e["type"] == "error"], sent
        starts = [e["audio_start_ms"] for e in sent if e["type"] == "input_audio_buffer.speech_started"]
        stops = [e["audio_end_ms"] for e in sent if e["type"] == "input_audio_buffer.speech_stopped"]
        (updated,) = [e["session"] for e in sent if e["type"] == "session.updated"]
        return list(zip(starts, stops)), updated["audio"]["input"]["turn_detection"], \
            [len(s.audio_of[i["id"]]) * 1000 // 2 // RATE for i in s.items]

    # (speech at 1.0-1.5 s and 2.5-3.0 s; a turn ends its silence after the last loud frame)
    spans, shown, lengths = turns("high")
    assert spans == [(700, 2000), (2200, 3500)] and lengths == [1300, 1300], (spans, lengths)
    assert shown == {"type": "semantic_vad", "eagerness": "high", "create_response": False, "interrupt_response": True}
    spans, shown, lengths = turns(None)
    # (the second turn's padding reaches back only to where the first ended)
    assert spans == [(700, 2300), (2300, 3800)] and shown["eagerness"] == "auto", spans
    assert lengths == [1600, 1500]
    spans, _, lengths = turns("low")
    assert spans == [(700, 4500)] and lengths == [3800], (spans, lengths)


def test_semantic_vad_settings_are_checked_as_server_vads_are():
    """Fields semantic_vad does not have (server_vad's threshold, silence, idle timeout) and values it
    does not take are refused, naming the field; a transcription session takes it making no responses."""
    import pytest

    from omni_server.api.realtime.events import EventError, turn_detection

    where = "session.audio.input.turn_detection"
    for given, param in (({"threshold": 0.5}, where), ({"idle_timeout_ms": 1000}, where),
                         ({"eagerness": "eager"}, f"{where}.eagerness"), ({"eagerness": ["low"]}, f"{where}.eagerness"),
                         ({"create_response": "yes"}, f"{where}.create_response")):
        with pytest.raises(EventError) as e:
            turn_detection({"type": "semantic_vad", **given})
        assert e.value.param == param, (given, e.value.param)
    assert turn_detection({"type": "semantic_vad", "eagerness": "low"}, "transcription") == {
        "type": "semantic_vad", "eagerness": "low", "create_response": False, "interrupt_response": False}
    with pytest.raises(EventError, match="makes no responses"):
        turn_detection({"type": "semantic_vad", "create_response": True}, "transcription")


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


class _FakeRun:
    """A chat run that yields `pieces` of text, slowly; records its abort."""

    def __init__(self, pieces: list[str]):
        self.pieces, self.aborted = pieces, False
        self.n_prompt, self.completion_tokens, self.n_cached, self.finish_reason = 3, 0, 0, "stop"

    async def first(self):
        return None

    async def stream_from(self, first):
        for p in self.pieces:
            await asyncio.sleep(0.01)
            self.completion_tokens += 1
            yield "text", p

    async def abort(self):
        self.aborted = True


class _ScoredRun(_FakeRun):
    """A run whose text tokens have log-probabilities (run.logprobs grows as they come; one more
    token, without text, at the end)."""

    def __init__(self, pieces: list[str]):
        super().__init__(pieces)
        self.logprobs = []

    async def stream_from(self, first):
        from types import SimpleNamespace

        for k, p in enumerate(self.pieces):
            self.logprobs.append(SimpleNamespace(token=p, logprob=-1.0 - k, bytes=list(p.encode())))
            yield "text", p
        self.logprobs.append(SimpleNamespace(token="<end>", logprob=-0.5, bytes=[]))


def test_a_response_cancelled_before_it_ran_is_dropped_and_said():
    """response.create then response.cancel at once (the response's task not yet run): its request
    is dropped and the client still gets response.created and response.done (cancelled)."""
    sent, runs = [], []

    async def send(event):
        sent.append(event)

    async def chat(body):
        runs.append(_FakeRun(["a", "b", "c"]))
        return runs[-1]

    async def talk():
        s = Session("m", send, chat, voices=[], has_audio=False, max_buffer_s=1.0, audio_cap=None)
        await _say(s, "hi")
        await _event(s, type="response.create")
        await _event(s, type="response.cancel")
        await _event(s, type="response.create")
        await s.response

    asyncio.run(talk())
    assert runs[0].aborted and not runs[1].aborted
    done = [e["response"] for e in sent if e["type"] == "response.done"]
    assert [d["status"] for d in done] == ["cancelled", "completed"]
    assert [e["type"] for e in sent].count("response.created") == 2
    assert done[1]["output"][0]["content"][0]["text"] == "abc"


def test_prefix_padding_holds_with_small_appends():
    """20 ms appends, speech from 1.0 s, 300 ms of padding: the turn starts at 0.7 s exactly."""
    sent: list = []
    s = _session(sent, max_buffer_s=5.0)
    audio = np.concatenate([_quiet(1.0), _tone(0.5), _quiet(0.6)])

    async def talk():
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": {
            "type": "server_vad", "create_response": False}}}})
        for k in range(0, len(audio), 480):
            await _event(s, type="input_audio_buffer.append", audio=_b64(audio[k:k + 480]))

    asyncio.run(talk())
    started = next(e for e in sent if e["type"] == "input_audio_buffer.speech_started")
    assert started["audio_start_ms"] == 700
    assert s.audio_of[s.items[0]["id"]] == audio[int(0.7 * RATE):int(2.0 * RATE)].tobytes()


def test_what_a_session_refuses_at_once():
    """Settings it would ignore, audio items it could not send, and audio past the cap with no way
    to transcribe it: each an error event when asked, not a failure later."""
    sent: list = []
    s = Session("m", lambda e: _append(sent, e), _no_chat, voices=[], has_audio=False, max_buffer_s=1.0,
                audio_cap=1, clip_s=0.5)

    async def talk():
        bad = [
            {"type": "session.update", "session": {"bogus": 1}},
            {"type": "session.update", "session": {"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}},
            {"type": "session.update", "session": {"audio": {"output": {"speed": 1.6}}}},
            {"type": "session.update", "session": {"tool_choice": "required"}},
            {"type": "response.create", "response": {"tools": [{"type": "function", "name": "f"}]}},
            {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": ""}]}},
            {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": _b64(_tone(0.6))}]}},
        ]
        for event in bad:
            await s.receive(json.dumps(event))
        for _ in range(2):
            await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": _b64(_tone(0.4))}]})
        await _event(s, type="conversation.item.create", previous_item_id="root", item={
            "type": "message", "role": "assistant", "content": [{"type": "output_audio", "transcript": "Hello."}]})
        await _event(s, type="response.create")

    asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["unknown_parameter", "invalid_value", "invalid_value", "invalid_value",
                                           "invalid_value", "invalid_audio_length", "invalid_audio_length",
                                           "too_many_audio_items"], errors
    assert errors[0]["param"] == "session.bogus" and errors[4]["param"] == "response.tools"
    assert s.items[0]["role"] == "assistant" and s.chat_body(s.config)["messages"][0] == {
        "role": "assistant", "content": "Hello."}


async def _append(sent: list, event: dict) -> None:
    sent.append(json.loads(json.dumps(event)))  # (as sent: a copy, in JSON)


async def _no_chat(body):
    raise AssertionError("no chat expected")


def _crowded(sent: list, bodies: list) -> Session:
    """A session on a 100-token context whose every reply's prompt is 90 tokens and whose output is
    5 (less than a quarter of the context left: each reply's end leaves room for the next); events
    to `sent`, chat bodies to `bodies`."""
    async def send(event):
        sent.append(event)

    async def chat(body):
        bodies.append(body)
        run = _FakeRun(["a"] * 5)
        run.n_prompt = 90
        return run

    return Session("m", send, chat, voices=[], has_audio=False, max_buffer_s=1.0, audio_cap=None, context=100)


def _users(bodies: list) -> list[list[str]]:
    return [[m["content"][0]["text"] for m in b["messages"] if m["role"] == "user"] for b in bodies]


def test_after_a_reply_left_too_little_room_the_next_prompt_starts_later():
    """A 100-token context: a reply whose prompt (90) and output (5) left 5 tokens, less than a
    quarter of the context, makes the next response leave out the oldest item (this prompt's ~22
    tokens an item, 20 short). Unknown fields in items and their parts are errors."""
    sent, bodies = [], []

    async def talk():
        s = _crowded(sent, bodies)
        for k in range(4):
            await _say(s, f"t{k}")
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "foo": 1,
                                                              "content": [{"type": "input_text", "text": "x"}]})
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user",
                                                              "content": [{"type": "input_text", "text": "x", "y": 2}]})
        for _ in range(2):
            await _event(s, type="response.create")
            await s.response

    asyncio.run(talk())
    assert [e["error"]["param"] for e in sent if e["type"] == "error"] == ["item.foo", "item.content[0].y"]
    assert _users(bodies) == [["t0", "t1", "t2", "t3"], ["t1", "t2", "t3"]]


def test_room_left_for_a_reply_is_given_back_when_the_last_prompt_shrinks():
    """The room a reply's end leaves for the next (the oldest item left out) is an estimate from its
    prompt's size: deleting an item that prompt held undoes it (an interrupted reply whose unheard
    transcript the client cuts would otherwise cost the conversation its start); deleting the item a
    prompt starts at starts the next at the item after it."""
    sent, bodies = [], []

    async def talk():
        s = _crowded(sent, bodies)
        for k in range(4):
            await _say(s, f"t{k}")
        ids = [i["id"] for i in s.items]
        for delete in (ids[2], ids[0], None):  # (in the last prompt; the one it started at)
            await _event(s, type="response.create")
            await s.response
            if delete is not None:
                await _event(s, type="conversation.item.delete", item_id=delete)

    asyncio.run(talk())
    assert not [e for e in sent if e["type"] == "error"], sent
    assert _users(bodies) == [["t0", "t1", "t2", "t3"], ["t0", "t1", "t3"], ["t1", "t3"]], _users(bodies)


def test_a_reply_whose_prompt_shrank_while_it_ran_leaves_no_room_estimate():
    """An item deleted while a reply runs (as a client truncates the reply it interrupted while the
    answer runs): that reply's prompt size no longer says how full the next prompt is, so its end
    leaves the conversation's start where it was."""
    sent, bodies = [], []

    async def talk():
        s = _crowded(sent, bodies)
        for k in range(4):
            await _say(s, f"t{k}")
        await _event(s, type="response.create")
        await asyncio.sleep(0.02)  # (its first pieces sent)
        assert not s.response.done()
        await _event(s, type="conversation.item.delete", item_id=s.items[2]["id"])
        await s.response
        await _event(s, type="response.create")
        await s.response

    asyncio.run(talk())
    assert not [e for e in sent if e["type"] == "error"], sent
    assert _users(bodies) == [["t0", "t1", "t2", "t3"], ["t0", "t1", "t3"]], _users(bodies)


def test_settings_it_cannot_honour_are_refused_and_metadata_comes_back():
    sent, runs = [], []

    async def send(event):
        sent.append(event)

    async def chat(body):
        runs.append(_FakeRun(["a"]))
        return runs[-1]

    async def talk():
        s = Session("m", send, chat, voices=[], has_audio=False, max_buffer_s=1.0, audio_cap=None)
        for session in ({"model": "other"}, {"include": ["item.output_audio.logprobs"]},
                        {"prompt": {"id": "pmpt_1"}}, {"audio": {"input": {"transcription": {"model": "x", "foo": 1}}}}):
            await _event(s, type="session.update", session=session)
        await _say(s, "hi")
        await _event(s, type="response.create", response={"metadata": {"k": 1}})
        await _event(s, type="response.create", response={"audio": {"output": {"format": {"type": "audio/opus"}}}})
        await _event(s, type="response.create", response={"metadata": {"turn": "7"}})
        await s.response

    asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [(e["code"], e["param"]) for e in errors] == [
        ("model_not_found", "session.model"), ("invalid_value", "session.include"),
        ("invalid_value", "session.prompt"), ("unknown_parameter", "session.audio.input.transcription.foo"),
        ("invalid_value", "response.metadata"), ("invalid_value", "response.audio.output.format")], errors
    done = next(e["response"] for e in sent if e["type"] == "response.done")
    assert done["metadata"] == {"turn": "7"} and len(runs) == 1


class _SpokenRun(_FakeRun):
    """A chat run that says one word and `seconds` of a 200 Hz tone at 24 kHz, in 0.1 s pieces."""

    def __init__(self, seconds: float):
        super().__init__(["hi"])
        self.seconds = seconds

    async def stream_from(self, first):
        yield "text", "hi"
        self.completion_tokens += 1
        n = int(self.seconds * RATE)
        wave = 0.3 * np.sin(2 * np.pi * 200 * np.arange(n) / RATE).astype(np.float32)
        for k in range(0, n, RATE // 10):
            await asyncio.sleep(0)
            yield "audio", (wave[k:k + RATE // 10], RATE)


def _spoken_session(sent: list, runs: list, seconds: float) -> Session:
    loop = asyncio.get_running_loop()

    async def send(event):
        sent.append({**event, "at": loop.time()})

    async def chat(body):
        runs.append(_SpokenRun(seconds))
        return runs[-1]

    return Session("m", send, chat, voices=["v"], has_audio=True, max_buffer_s=5.0, audio_cap=None)


def _heard_samples(sent: list, response_id: str) -> int:
    return sum(len(base64.b64decode(e["delta"])) // 2 for e in sent
               if e["type"] == "response.output_audio.delta" and e["response_id"] == response_id)


def test_truncating_a_spoken_reply_gives_back_the_room_only_when_it_cuts():
    """conversation.item.truncate of a reply the last prompt held undoes that prompt's room estimate
    when it cuts the reply; a truncate to the reply's whole length cuts nothing and leaves it."""
    sent, bodies = [], []

    async def send(event):
        sent.append(event)

    async def chat(body):
        bodies.append(body)
        run = _SpokenRun(0.3)
        run.n_prompt = 90  # (a 100-token context: each reply's end leaves room)
        return run

    async def talk():
        s = Session("m", send, chat, voices=["v"], has_audio=True, max_buffer_s=5.0, audio_cap=None, context=100)
        for k in range(4):
            await _say(s, f"t{k}")
        await _event(s, type="response.create")
        await s.response
        reply = s.items[4]["id"]
        for end in (s.spoken_ms[reply], 0):
            await _event(s, type="conversation.item.truncate", item_id=reply, content_index=0, audio_end_ms=end)
            await _event(s, type="response.create")
            await s.response

    asyncio.run(talk())
    assert not [e for e in sent if e["type"] == "error"], sent
    assert _users(bodies) == [["t0", "t1", "t2", "t3"], ["t1", "t2", "t3"], ["t1", "t2", "t3"]], _users(bodies)


def test_a_reply_truncated_while_it_runs_is_cut_when_it_ends():
    """A barge-in (OpenAI's Agents SDK interrupts this way): conversation.item.truncate of the reply
    still being made, at most to the audio it has sent so far, is said at once and cut when the
    reply ends: its conversation item holds the words heard, the response's output all it said,
    and the next prompt reads what was heard."""
    sent, bodies, runs = [], [], []

    class Talking(_FakeRun):
        """Four words, then 1 s of tone in 0.1 s pieces, holding at 0.5 s until `go`."""

        def __init__(self):
            super().__init__([])
            self.half, self.go = asyncio.Event(), asyncio.Event()

        async def stream_from(self, first):
            yield "text", "one two three four"
            self.completion_tokens += 4
            wave = 0.3 * np.sin(2 * np.pi * 200 * np.arange(RATE) / RATE).astype(np.float32)
            for k in range(10):
                if k == 5:
                    self.half.set()
                    await self.go.wait()
                yield "audio", (wave[k * RATE // 10:(k + 1) * RATE // 10], RATE)

    async def send(event):
        sent.append(event)

    async def chat(body):
        bodies.append(body)
        runs.append(Talking() if len(runs) == 0 else _FakeRun(["ok"]))
        return runs[-1]

    async def talk():
        s = Session("m", send, chat, voices=["v"], has_audio=True, max_buffer_s=5.0, audio_cap=None)
        await _say(s, "hi")
        await _event(s, type="response.create")
        while not runs:
            await asyncio.sleep(0)
        await runs[0].half.wait()
        reply = s.items[1]["id"]
        await _event(s, type="conversation.item.truncate", item_id=reply, content_index=0, audio_end_ms=600)
        await _event(s, type="conversation.item.truncate", item_id=reply, content_index=0, audio_end_ms=250)
        truncated_before_end = [e for e in sent if e["type"] in ("conversation.item.truncated", "response.done")]
        runs[0].go.set()
        await s.response
        await _event(s, type="response.create", response={"output_modalities": ["text"]})
        await s.response
        return s, reply, truncated_before_end

    s, reply, early = asyncio.run(talk())
    (error,) = [e["error"] for e in sent if e["type"] == "error"]
    assert error["param"] == "audio_end_ms" and "500 ms of audio sent so far" in error["message"], error
    assert [e["type"] for e in early] == ["conversation.item.truncated"] and early[0]["audio_end_ms"] == 250
    (done_item,) = [e["item"] for e in sent if e["type"] == "conversation.item.done" and e["item"]["id"] == reply]
    assert done_item["content"][0]["transcript"] == "one"  # (250 of 1000 ms: a quarter of the words, whole)
    (first_done, _) = [e["response"] for e in sent if e["type"] == "response.done"]
    assert first_done["output"][0]["content"][0]["transcript"] == "one two three four"
    assert s.spoken_ms[reply] == 250 and s.items[1]["content"][0]["transcript"] == "one"
    assert [m["content"] for m in bodies[1]["messages"] if m["role"] == "assistant"] == ["one"], bodies[1]


def test_output_speed_stretches_the_spoken_reply():
    """audio.output.speed: 1 s of generated speech comes out as 1 / speed seconds (the stretch's
    flush included), the session echoes the speed, and a speed past OpenAI's 0.25-1.5 is refused."""
    sent, runs = [], []

    async def talk():
        s = _spoken_session(sent, runs, 1.0)
        await _event(s, type="session.update", session={"audio": {"output": {"speed": 2.0}}})
        await _say(s, "hi")
        for speed in (1.5, 0.5, 1.0):
            await _event(s, type="session.update", session={"audio": {"output": {"speed": speed}}})
            await _event(s, type="response.create")
            await s.response

    asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [e["param"] for e in errors] == ["session.audio.output.speed"]
    assert [e["session"]["audio"]["output"]["speed"] for e in sent if e["type"] == "session.updated"] == [1.5, 0.5, 1.0]
    done = [e["response"] for e in sent if e["type"] == "response.done"]
    assert [d["status"] for d in done] == ["completed"] * 3
    assert [_heard_samples(sent, d["id"]) for d in done] == [16000, 48000, 24000]


def test_idle_timeout_answers_a_silent_user_after_the_reply_has_played():
    """server_vad with idle_timeout_ms: after a reply with 0.3 s of audio, no speech for the
    timeout (0.2 s) past its playback commits the buffer as a user turn and answers it
    (input_audio_buffer.timeout_triggered first); speech under way stops the timer."""
    sent, runs = [], []

    async def talk():
        s = _spoken_session(sent, runs, 0.3)
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": {
            "type": "server_vad", "idle_timeout_ms": 50000000}}}})
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": {
            "type": "server_vad", "idle_timeout_ms": 200, "create_response": False}}}})
        await _say(s, "hi")
        await _event(s, type="response.create")
        await s.response
        await _event(s, type="input_audio_buffer.append", audio=_b64(_quiet(0.05)))
        await asyncio.sleep(0.75)
        await s.response  # (the one the timeout made)
        await _event(s, type="input_audio_buffer.append", audio=_b64(_tone(0.2)))  # (a turn starts)
        await asyncio.sleep(1.0)
        await s.close()
        return s

    s = asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [e["param"] for e in errors] == ["session.audio.input.turn_detection.idle_timeout_ms"]
    kinds = [e["type"] for e in sent]
    assert kinds.count("input_audio_buffer.timeout_triggered") == 1 and kinds.count("response.done") == 2
    done = next(e for e in sent if e["type"] == "response.done")
    timeout = next(e for e in sent if e["type"] == "input_audio_buffer.timeout_triggered")
    assert timeout["at"] - done["at"] >= 0.5  # (0.3 s of playback, then 0.2 s)
    committed = next(e for e in sent if e["type"] == "input_audio_buffer.committed")
    assert committed["item_id"] == timeout["item_id"] and timeout["audio_end_ms"] == 50
    assert len(s.audio_of[timeout["item_id"]]) == 2 * int(0.1 * RATE)  # (50 ms heard, padded to the least item)
    assert [i["role"] for i in s.items] == ["user", "assistant", "user", "assistant"]
    assert kinds.index("input_audio_buffer.timeout_triggered") < kinds.index("input_audio_buffer.committed") \
        < kinds.index("response.created", kinds.index("input_audio_buffer.timeout_triggered"))
    assert kinds[-1] == "input_audio_buffer.speech_started"


def _png(width: int, height: int, seed: int = 0) -> str:
    import io

    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_item(url: str, detail: str | None = None, text: str | None = None) -> dict:
    part = {"type": "input_image", "image_url": url} | ({"detail": detail} if detail else {})
    return {"type": "message", "role": "user",
            "content": [part] + ([{"type": "input_text", "text": text}] if text else [])}


def test_images_in_items_the_latest_the_pipeline_sees_a_prompt():
    """input_image parts (data URLs, checked at create): a prompt holds the latest `image_cap`
    images (older ones left out); `detail: low` sends the image within 512 x 512; a conversation
    keeps 4 prompts' worth (the oldest image item deleted past that); bad images are refused."""
    import io

    from PIL import Image

    sent: list = []
    s = Session("m", lambda e: _append(sent, e), _no_chat, voices=[], has_audio=False, max_buffer_s=1.0,
                audio_cap=None, image_cap=1, image_limits=(8 << 20, 1 << 20))
    a, b = _png(64, 48, 1), _png(1024, 768, 2)

    async def talk():
        for item in (_image_item(a, text="first"), _image_item(b, detail="low", text="second"),
                     _image_item("https://example.com/x.png"), _image_item("data:image/png;base64,AAAA"),
                     _image_item(_png(1100, 1000)), _image_item(a, detail="ultra")):
            await _event(s, type="conversation.item.create", item=item)
        first, second = s.items[0]["id"], s.items[1]["id"]
        await _event(s, type="conversation.item.retrieve", item_id=second)
        body = s.chat_body(s.config)
        for k in range(3):
            await _event(s, type="conversation.item.create", item=_image_item(a, text=f"more {k}"))
        return first, second, body

    first, second, body = asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [e["param"] for e in errors] == ["item.content[0].image_url"] * 3 + ["item.content[0]"], errors
    assert "pixels" in errors[2]["message"]
    assert body["messages"][0]["content"] == [{"type": "text", "text": "first"}]  # (past the cap: left out)
    [image_part, text_part] = body["messages"][1]["content"]
    assert text_part == {"type": "text", "text": "second"}
    low = image_part["image_url"]["url"]
    with Image.open(io.BytesIO(base64.b64decode(low.split(",", 1)[1]))) as img:
        assert img.size == (512, 384)
    got = next(e for e in sent if e["type"] == "conversation.item.retrieved")["item"]
    assert got["content"][0] == {"type": "input_image", "detail": "low", "image_url": low}
    added = [e["item"] for e in sent if e["type"] == "conversation.item.added"]
    assert all("image_url" not in p for i in added for p in i["content"])  # (not echoed back in each event)
    assert [e["item_id"] for e in sent if e["type"] == "conversation.item.deleted"] == [first]
    assert len(s.items) == 4 and second in s.images_of


def test_images_past_the_cap_with_truncation_disabled_and_a_model_without_images():
    sent: list = []
    s = Session("m", lambda e: _append(sent, e), _no_chat, voices=[], has_audio=False, max_buffer_s=1.0,
                audio_cap=None, image_cap=1, image_limits=(1 << 20, 1 << 20))
    none = Session("m", lambda e: _append(sent, e), _no_chat, voices=[], has_audio=False, max_buffer_s=1.0,
                   audio_cap=None, image_cap=0)

    async def talk():
        await _event(s, type="session.update", session={"truncation": "disabled"})
        for k in range(2):
            await _event(s, type="conversation.item.create", item=_image_item(_png(8, 8, k)))
        await _event(s, type="response.create")
        await _event(none, type="conversation.item.create", item=_image_item(_png(8, 8)))

    asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["too_many_images", "invalid_value"], errors
    assert "takes no images" in errors[1]["message"] and not none.items


def test_a_transcription_session_transcribes_each_turn_and_makes_no_responses():
    """intent=transcription: server_vad turns are committed and transcribed (delta events as the
    text comes, then completed); response and item events, conversation settings, a null
    transcription and response-making turn detection are refused."""
    sent, bodies = [], []

    async def send(event):
        sent.append(event)

    async def chat(body):
        bodies.append(body)
        return _ScoredRun(["he", "llo"])

    async def talk():
        s = Session("m", send, chat, voices=[], has_audio=False, max_buffer_s=5.0, audio_cap=None, kind="transcription",
                    transcription_turn=lambda language, prompt: [{"role": "user", "content": [
                        {"type": "audio"}, {"type": "text", "text": f"say {language}"}]}])
        await s.start()
        for event in ({"type": "response.create"}, {"type": "conversation.item.create", "item": {}},
                      {"type": "session.update", "session": {"type": "realtime"}},
                      {"type": "session.update", "session": {"instructions": "x"}},
                      {"type": "session.update", "session": {"audio": {"output": {"voice": "v"}}}},
                      {"type": "session.update", "session": {"audio": {"input": {"transcription": None}}}},
                      {"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
                          "type": "server_vad", "create_response": True}}}}}):
            await s.receive(json.dumps(event))
        await _event(s, type="session.update", session={"type": "transcription", "audio": {"input": {
            "transcription": {"model": "m", "language": "en"}}}, "include": ["item.input_audio_transcription.logprobs"]})
        for piece in (_quiet(0.5), _tone(1.0), _quiet(1.0)):
            await _event(s, type="input_audio_buffer.append", audio=_b64(piece))
        await asyncio.gather(*s.transcribing.values())
        return s

    s = asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [(e["code"], e["param"]) for e in errors] == [
        ("unsupported_event", "type"), ("unsupported_event", "type"), ("invalid_value", "session.type"),
        ("unknown_parameter", "session.instructions"), ("unknown_parameter", "session.audio.output"),
        ("invalid_value", "session.audio.input.transcription"),
        ("invalid_value", "session.audio.input.turn_detection.create_response")], errors
    created = sent[0]["session"]
    assert created["type"] == "transcription" and created["audio"]["input"]["transcription"]["model"] == "m"
    assert created["audio"]["input"]["turn_detection"]["create_response"] is False
    kinds = [e["type"] for e in sent if e["type"] != "error"]
    assert kinds[-8:] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                          "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done",
                          "conversation.item.input_audio_transcription.delta",
                          "conversation.item.input_audio_transcription.delta",
                          "conversation.item.input_audio_transcription.completed"], kinds
    deltas = [e for e in sent if e["type"].endswith("transcription.delta")]
    assert [e["delta"] for e in deltas] == ["he", "llo"]
    assert [e["logprobs"] for e in deltas] == [[{"token": "he", "logprob": -1.0, "bytes": [104, 101]}],
                                              [{"token": "llo", "logprob": -2.0, "bytes": [108, 108, 111]}]]
    assert sent[-1]["transcript"] == "hello" and s.items[0]["content"][0]["transcript"] == "hello"
    assert [p["token"] for p in sent[-1]["logprobs"]] == ["he", "llo", "<end>"]  # (the last token has no text)
    [body] = bodies
    assert body["modalities"] == ["text"] and body["messages"][0]["content"][1]["text"] == "say en"
    assert body["logprobs"] is True


def test_a_response_with_its_own_input():
    """response.input: the prompt holds those items (references to the conversation's, or new
    ones) instead of the conversation; `[]` the instructions alone; with conversation none the
    reply stays out of the conversation, with auto it joins it. Bad inputs are refused."""
    sent, bodies = [], []

    async def send(event):
        sent.append(event)

    async def chat(body):
        bodies.append(body)
        return _FakeRun(["ok"])

    async def talk():
        s = Session("m", send, chat, voices=[], has_audio=False, max_buffer_s=1.0, audio_cap=1)
        await _event(s, type="session.update", session={"instructions": "sys"})
        for role, text in (("user", "a"), ("assistant", "b")):
            await _event(s, type="conversation.item.create", item={"type": "message", "role": role, "content": [
                {"type": "input_text" if role == "user" else "output_text", "text": text}]})
        first = s.items[0]["id"]
        new = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "c"}]}
        for response in ({"input": "x"}, {"input": [{"type": "item_reference", "id": "nope"}]},
                         {"input": [{"type": "item_reference", "id": first}, {"type": "item_reference", "id": first}]},
                         {"input": [{"type": "message", "role": "user", "content": [
                             {"type": "input_audio", "audio": _b64(_tone(0.2))}]}, {"type": "message", "role": "user",
                             "content": [{"type": "input_audio", "audio": _b64(_tone(0.2))}]}]}):
            await _event(s, type="response.create", response=response)
        await _event(s, type="response.create", response={"conversation": "none", "input": [
            {"type": "item_reference", "id": first}, new]})
        await s.response
        assert len(s.items) == 2
        await _event(s, type="response.create", response={"conversation": "none", "input": []})
        await s.response
        await _event(s, type="response.create", response={"input": [new]})
        await s.response
        return s

    s = asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [(e["code"], e["param"]) for e in errors] == [
        ("invalid_value", "response.input"), ("item_not_found", "response.input[0].id"),
        ("invalid_value", "response.input[1].id"), ("too_many_audio_items", None)], errors
    assert [m["content"] for m in bodies[0]["messages"]] == ["sys", [{"type": "text", "text": "a"}],
                                                             [{"type": "text", "text": "c"}]]
    assert bodies[1]["messages"] == [{"role": "system", "content": "sys"}]
    assert [i["role"] for i in s.items] == ["user", "assistant", "assistant"]
    assert s.items[-1]["content"][0]["text"] == "ok"


class _SlowStart:
    """A chat that takes `delay` s to start each run (a long prompt's checks), its runs recorded."""

    def __init__(self, delay: float):
        self.delay, self.runs = delay, []

    async def __call__(self, body):
        await asyncio.sleep(self.delay)
        self.runs.append(_FakeRun(["x"]))
        return self.runs[-1]


def test_the_idle_timer_and_a_clients_response_never_make_two_responses():
    """A client's response.create whose start takes longer than the idle timeout makes the only
    response (the timer neither fires meanwhile nor makes a second one); a response.create while
    the timer's own response is starting is refused."""
    sent: list = []
    chat = _SlowStart(0.3)

    async def talk():
        s = Session("m", lambda e: _append(sent, e), chat, voices=[], has_audio=False, max_buffer_s=1.0,
                    audio_cap=None)
        await _say(s, "hi")
        vad = {"type": "server_vad", "idle_timeout_ms": 100}
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": vad}}})
        await _event(s, type="response.create")  # (0.3 s to start: past the timer's 0.1 s)
        await s.response
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": {**vad, "threshold": 0.6}}}})
        await asyncio.sleep(0.15)  # (the timer fired: its response is starting)
        await _event(s, type="response.create")
        await asyncio.sleep(0.3)
        await s.response
        await s.close()

    asyncio.run(talk())
    kinds = [e["type"] for e in sent]
    assert kinds.count("response.created") == 2 and len(chat.runs) == 2, kinds
    assert kinds.count("input_audio_buffer.timeout_triggered") == 1
    assert kinds.index("input_audio_buffer.timeout_triggered") > kinds.index("response.done")
    assert [e["error"]["code"] for e in sent if e["type"] == "error"] == ["conversation_already_has_active_response"]


def test_new_turn_detection_settings_keep_the_replys_playback_in_the_idle_timer():
    """session.update (new settings) right after a reply with 0.5 s of audio: the timer still
    counts from the end of its playback."""
    sent, runs = [], []

    async def talk():
        s = _spoken_session(sent, runs, 0.5)
        vad = {"type": "server_vad", "idle_timeout_ms": 5000}
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": vad}}})
        await _say(s, "hi")
        await _event(s, type="response.create")
        await s.response
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": {
            **vad, "idle_timeout_ms": 100}}}})
        await asyncio.sleep(0.9)
        await s.close()

    asyncio.run(talk())
    done = next(e for e in sent if e["type"] == "response.done")
    timeout = next(e for e in sent if e["type"] == "input_audio_buffer.timeout_triggered")
    assert timeout["at"] - done["at"] >= 0.6


def test_malformed_parts_settings_and_events_are_refused_and_a_gone_socket_ends_quietly():
    """Fields a part's type does not have, non-object `audio`, an event over the size limit and
    an image past the processors' 200:1 are error events; a send that fails marks the session
    gone (no exception into the caller, nothing sent after)."""
    sent: list = []
    s = Session("m", lambda e: _append(sent, e), _no_chat, voices=[], has_audio=False, max_buffer_s=1.0,
                audio_cap=None, image_cap=1, image_limits=(1 << 20, 1 << 20), max_event_bytes=4000)

    async def talk():
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "x", "detail": "high"}]})
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": _png(8, 8), "transcript": "t"}]})
        await _event(s, type="session.update", session={"audio": []})
        await _event(s, type="session.update", session={"audio": {"input": []}})
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "x" * 5000}]})
        await _event(s, type="conversation.item.create", item=_image_item(_png(2, 401)))

    asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [(e["code"], e["param"]) for e in errors] == [
        ("unknown_parameter", "item.content[0].detail"), ("unknown_parameter", "item.content[0].transcript"),
        ("invalid_value", "session.audio"), ("invalid_value", "session.audio"), ("event_too_large", None),
        ("invalid_value", "item.content[0].image_url")], errors
    assert "200 times" in errors[-1]["message"] and not s.items

    tries = []

    async def broken(event):
        tries.append(event)
        raise RuntimeError("the socket is closed")

    gone = Session("m", broken, _no_chat, voices=[], has_audio=False, max_buffer_s=1.0, audio_cap=None)
    asyncio.run(gone.receive("not json"))
    asyncio.run(gone.receive("not json either"))
    assert gone.closed and len(tries) == 1


def test_an_items_transcript_lands_on_its_audio_part():
    """An item of text then audio, input transcription on: the transcript is the audio part's
    (content_index 1), the text part stays as it was."""
    sent: list = []

    async def chat(body):
        return _FakeRun(["wo", "rds"])

    async def talk():
        s = Session("m", lambda e: _append(sent, e), chat, voices=[], has_audio=False, max_buffer_s=1.0,
                    audio_cap=None, transcription_turn=lambda language, prompt: [{"role": "user", "content": [
                        {"type": "audio"}]}])
        await _event(s, type="session.update", session={"audio": {"input": {"transcription": {"model": "m"}}}})
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "listen:"}, {"type": "input_audio", "audio": _b64(_tone(0.3))}]})
        await asyncio.gather(*s.transcribing.values())
        return s

    s = asyncio.run(talk())
    done = next(e for e in sent if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert done["content_index"] == 1 and done["transcript"] == "words" and "logprobs" not in done
    assert s.items[0]["content"] == [{"type": "input_text", "text": "listen:"},
                                     {"type": "input_audio", "transcript": "words"}]


class _HeldChat:
    """A chat whose runs wait until released (`go`); counts the runs it holds at once."""

    def __init__(self):
        self.go, self.now, self.most, self.bodies = asyncio.Event(), 0, 0, []

    async def __call__(self, body):
        self.bodies.append(body)
        chat = self

        class Run(_FakeRun):
            async def first(self):
                chat.now += 1
                chat.most = max(chat.most, chat.now)
                try:
                    await chat.go.wait()
                finally:
                    chat.now -= 1

        return Run(["w"])


def _transcribing_session(sent: list, chat, **kw) -> Session:
    return Session("m", lambda e: _append(sent, e), chat, voices=[], has_audio=False, max_buffer_s=1.0,
                   audio_cap=None, transcription_turn=lambda language, prompt: [{"role": "user", "content": [
                       {"type": "audio"}]}], **kw)


def test_a_session_transcribes_two_items_at_a_time_and_keeps_those_under_way():
    """Six audio items with input transcription on: two transcriptions run at once, the rest
    wait. Past the audio kept (4 x 1 s), an untranscribed item no transcript is coming for gives
    way before one still being transcribed."""
    sent: list = []
    chat = _HeldChat()

    async def talk():
        s = _transcribing_session(sent, chat)
        await _event(s, type="session.update", session={"audio": {"input": {
            "turn_detection": None, "transcription": {"model": "m", "language": ""}}}})
        assert s.config["transcription"]["language"] is None
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": _b64(_tone(1.0))}]})
        pending = s.items[0]["id"]
        await _event(s, type="session.update", session={"audio": {"input": {"transcription": None}}})
        for _ in range(4):
            await _event(s, type="input_audio_buffer.append", audio=_b64(_tone(1.0)))
            await _event(s, type="input_audio_buffer.commit")
        untranscribed = [e["item_id"] for e in sent if e["type"] == "input_audio_buffer.committed"][:2]
        await _event(s, type="session.update", session={"audio": {"input": {"transcription": {"model": "m"}}}})
        for _ in range(5):
            await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": _b64(_tone(0.1))}]})
        await asyncio.sleep(0.05)
        held = chat.now
        chat.go.set()
        await asyncio.gather(*s.transcribing.values())
        return s, pending, untranscribed, held

    s, pending, untranscribed, held = asyncio.run(talk())
    assert held == 2 and chat.most == 2 and len(chat.bodies) == 6
    # (the fourth 1 s commit, and the first 0.1 s item, each make room: the oldest items without a
    # transcript coming go, not the older one being transcribed)
    assert [e["item_id"] for e in sent if e["type"] == "conversation.item.deleted"] == untranscribed
    assert any(i["id"] == pending for i in s.items)
    assert sum(e["type"].endswith("transcription.completed") for e in sent) == 6


def test_a_reply_holds_its_place_while_it_runs_and_nothing_starts_once_closed():
    """The reply's item joins the conversation as it starts: an item created while it runs comes
    after it, it can be retrieved (in progress), and the next prompt leaves nothing out of order.
    A session closed while a reply runs starts no transcription afterwards."""
    sent: list = []
    chat = _HeldChat()

    async def talk():
        s = Session("m", lambda e: _append(sent, e), chat, voices=[], has_audio=False, max_buffer_s=1.0,
                    audio_cap=1, transcription_turn=lambda language, prompt: [{"role": "user", "content": [
                        {"type": "audio"}]}])
        for k in range(2):
            await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": _b64(_tone(0.2)), "transcript": f"said {k}"}]})
        await _event(s, type="response.create")
        reply = s.reply.item_id
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user",
                                                              "content": [{"type": "input_text", "text": "x"}]})
        await _event(s, type="conversation.item.retrieve", item_id=reply)
        await _event(s, type="response.cancel", response_id="resp_other")
        chat.go.set()
        await s.response
        order = [i["id"] for i in s.items]
        return s, reply, order

    s, reply, order = asyncio.run(talk())
    added = next(e for e in sent if e["type"] == "conversation.item.added" and e["item"]["id"] == reply)
    later = [e for e in sent if e["type"] == "conversation.item.added" and e["item"].get("role") == "user"][-1]
    assert later["previous_item_id"] == reply and order.index(reply) == 2 and len(order) == 4
    done = next(e for e in sent if e["type"] == "conversation.item.done" and e["item"]["id"] == reply)
    assert done["previous_item_id"] == added["previous_item_id"] == order[1]
    retrieved = next(e for e in sent if e["type"] == "conversation.item.retrieved")
    assert retrieved["item"]["status"] == "in_progress"
    assert [e["error"]["param"] for e in sent if e["type"] == "error"] == ["response_id"]
    body = s.chat_body(s.config)  # (the reply in its place, then the item created while it ran)
    assert [m["role"] for m in body["messages"]] == ["user", "user", "assistant", "user"]


def test_a_closed_session_starts_no_transcription():
    """Audio items past the cap are read by the session's own transcripts, started after each
    response; once the socket is gone none start (they would be pipeline requests nobody reads)."""
    sent: list = []
    chat = _HeldChat()

    async def talk():
        s = _transcribing_session(sent, chat, )
        s.audio_cap = 1
        for _ in range(2):
            await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": _b64(_tone(0.2))}]})
        await s.close()
        s._read_ahead(also_latest=True)
        started = dict(s.transcribing)
        s.closed = False  # (the same call on an open session does start them)
        s._read_ahead(also_latest=True)
        opened = len(s.transcribing)
        for task in s.transcribing.values():
            task.cancel()
        return started, opened

    started, opened = asyncio.run(talk())
    assert not started and opened == 2


def test_small_refusals():
    """A turn too short to hear is dropped quietly; unknown event fields, an event over the limit
    in bytes (not characters), an empty input without instructions, two images in an input with
    truncation disabled are error events; `conversation: null` is auto."""
    sent, bodies = [], []

    async def chat(body):
        bodies.append(body)
        return _FakeRun(["ok"])

    async def talk():
        s = Session("m", lambda e: _append(sent, e), chat, voices=[], has_audio=False, max_buffer_s=2.0,
                    audio_cap=None, image_cap=1, image_limits=(1 << 20, 1 << 20), max_event_bytes=30000)
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": {
            "type": "server_vad", "prefix_padding_ms": 0, "silence_duration_ms": 20}}}})
        await _event(s, type="input_audio_buffer.append", audio=_b64(np.concatenate([_tone(0.04), _quiet(0.3)])))
        await _event(s, type="input_audio_buffer.append", audio="", extra=1)
        await s.receive(json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                    "content": [{"type": "input_text", "text": "é" * 16000}]}}, ensure_ascii=False))
        await _event(s, type="session.update", session={"truncation": "disabled"})
        await _event(s, type="response.create", response={"input": []})
        image = {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": _png(4, 4)}]}
        await _event(s, type="response.create", response={"input": [image, {**image}]})
        await _event(s, type="response.create", response={"conversation": None, "input": [image]})
        await s.response
        return s

    s = asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [(e["code"], e["param"]) for e in errors] == [
        ("unknown_parameter", "extra"), ("event_too_large", None), ("invalid_value", "response.input"),
        ("too_many_images", None)], errors
    kinds = [e["type"] for e in sent]
    assert "input_audio_buffer.speech_stopped" in kinds and "input_audio_buffer.committed" not in kinds
    assert len(bodies) == 1 and s.items[-1]["role"] == "assistant"  # (conversation null: the reply joined it)


def test_telephone_formats_in_and_out():
    """Input audio/pcmu: a 300 Hz tone as mu-law at 8 kHz, appended in 20 ms pieces, is kept as
    24 kHz PCM16 of that tone (3 samples each); retrieve gives it back as mu-law. Output audio/pcma
    (the session's) or audio/pcmu (a response's): the reply's 0.5 s at 24 kHz comes as 4,000
    A-law / mu-law bytes (and the conversion's last few) of the same tone."""
    from omni_server.api import telephony

    sent, runs = [], []

    async def talk():
        s = _spoken_session(sent, runs, 0.5)
        await _event(s, type="session.update", session={"audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
            "output": {"format": {"type": "audio/pcma"}}}})
        await _event(s, type="session.update", session={"audio": {"input": {"format": {"type": "audio/pcmu",
                                                                                         "rate": 8000}}}})
        tone = (8000 * np.sin(2 * np.pi * 300 * np.arange(8000) / 8000)).astype(np.int16)
        law = telephony.ulaw_encode(tone)
        for k in range(0, len(law), 160):
            await _event(s, type="input_audio_buffer.append", audio=base64.b64encode(law[k:k + 160]).decode())
        await _event(s, type="input_audio_buffer.commit")
        await _event(s, type="conversation.item.retrieve", item_id=s.items[0]["id"])
        await _event(s, type="response.create")
        await s.response
        await _event(s, type="response.create", response={"audio": {"output": {"format": {"type": "audio/pcmu"}}}})
        await s.response
        return s, tone

    s, tone = asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [e["param"] for e in errors] == ["session.audio.input.format.rate"], errors
    updated = next(e for e in sent if e["type"] == "session.updated")["session"]
    assert updated["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    kept = np.frombuffer(s.audio_of[s.items[0]["id"]], "<i2").astype(np.float32)
    assert kept.size == 3 * 8000 - telephony.DELAY  # (the last millisecond still in the filter)
    expected = 8000 * np.sin(2 * np.pi * 300 * np.arange(kept.size) / 24000)
    assert np.abs(kept[2000:-200] - expected[2000:-200]).max() < 400  # (mu-law's steps at this level)
    back = next(e for e in sent if e["type"] == "conversation.item.retrieved")["item"]["content"][0]["audio"]
    heard = telephony.ulaw_decode(base64.b64decode(back)).astype(np.float32)
    assert heard.size == 8000 - telephony.DELAY // 3 and np.corrcoef(heard[100:7800], tone[100:7800])[0, 1] > 0.99
    done = [e["response"] for e in sent if e["type"] == "response.done"]
    assert [d["audio"]["output"]["format"] for d in done] == [{"type": "audio/pcma"}, {"type": "audio/pcmu"}]
    for d, decode in zip(done, (telephony.alaw_decode, telephony.ulaw_decode)):
        raw = b"".join(base64.b64decode(e["delta"]) for e in sent
                       if e["type"] == "response.output_audio.delta" and e["response_id"] == d["id"])
        said = decode(raw).astype(np.float32) / 32768
        assert said.size == 4000
        reply = 0.3 * np.sin(2 * np.pi * 200 * np.arange(said.size) / 8000)
        assert np.abs(said[100:3900] - reply[100:3900]).max() < 0.02


def test_a_cancel_while_a_reply_sends_its_last_events_waits_for_them():
    """response.cancel landing while a finished reply sends its closing events (a slow socket):
    they all go out, response.done included, and its item is done in the conversation."""
    sent: list = []

    async def slow(event):
        if event["type"] == "response.output_item.done":
            await asyncio.sleep(0.2)
        sent.append(event)

    async def chat(body):
        return _FakeRun(["a"])

    async def talk():
        s = Session("m", slow, chat, voices=[], has_audio=False, max_buffer_s=1.0, audio_cap=None)
        await _say(s, "hi")
        await _event(s, type="response.create")
        while not any(e["type"] == "response.content_part.done" for e in sent):
            await asyncio.sleep(0.01)
        await _event(s, type="response.cancel")
        return s

    s = asyncio.run(talk())
    assert [e["response"]["status"] for e in sent if e["type"] == "response.done"] == ["completed"]
    assert s.items[-1]["status"] == "completed" and s.items[-1]["content"][0]["text"] == "a"


def test_odd_types_are_error_events_and_the_spared_item_keeps_its_audio():
    """A list or object where a `type` string belongs: an error event, not a dead socket. An item
    created after the latest one (`previous_item_id`) past the audio kept: the oldest gives way,
    the one it follows keeps its audio."""
    sent: list = []
    s = Session("m", lambda e: _append(sent, e), _no_chat, voices=[], has_audio=False, max_buffer_s=1.0,
                audio_cap=None)

    async def talk():
        await _event(s, type="session.update", session={"audio": {"input": {"format": {"type": []}}}})
        await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": {}}]})
        for _ in range(4):
            await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": _b64(_tone(1.0))}]})
        oldest, latest = s.items[0]["id"], s.items[-1]["id"]
        await _event(s, type="conversation.item.create", previous_item_id=latest, item={
            "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": _b64(_tone(1.0))}]})
        return oldest, latest

    oldest, latest = asyncio.run(talk())
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [e["param"] for e in errors] == ["session.audio.input.format", "item.content[0]"], errors
    assert [e["item_id"] for e in sent if e["type"] == "conversation.item.deleted"] == [oldest]
    assert latest in s.audio_of and len(s.items) == 4


def test_a_failed_transcript_is_tried_again():
    """A session's own transcript of an audio item past the cap fails (the server busy): that
    response is refused, and the next response.create tries the transcript again."""
    from omni_server.api.errors import APIError

    sent, calls = [], []

    async def chat(body):
        calls.append(body)
        if len(calls) == 1:
            raise APIError(429, "server is at its limit")
        return _FakeRun(["x"])

    async def talk():
        s = Session("m", lambda e: _append(sent, e), chat, voices=[], has_audio=False, max_buffer_s=1.0,
                    audio_cap=1, transcription_turn=lambda language, prompt: [{"role": "user", "content": [
                        {"type": "audio"}]}])
        for _ in range(2):
            await _event(s, type="conversation.item.create", item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": _b64(_tone(0.2))}]})
        await _event(s, type="response.create")
        await _event(s, type="response.create")
        await s.response
        return s

    s = asyncio.run(talk())
    assert [e["error"]["code"] for e in sent if e["type"] == "error"] == ["too_many_audio_items"]
    assert [e["response"]["status"] for e in sent if e["type"] == "response.done"] == ["completed"]
    assert s.read_as[s.items[0]["id"]] == "x"


def test_speech_during_the_idle_timers_response_does_not_cut_it_half_way():
    """The idle timer's response takes 0.3 s to start; speech starting meanwhile does not cancel
    it part way: its item is committed whole and its response runs."""
    sent: list = []
    chat = _SlowStart(0.3)

    async def talk():
        s = Session("m", lambda e: _append(sent, e), chat, voices=[], has_audio=False, max_buffer_s=2.0,
                    audio_cap=None)
        await _say(s, "hi")
        await _event(s, type="session.update", session={"audio": {"input": {"turn_detection": {
            "type": "server_vad", "idle_timeout_ms": 100, "create_response": False}}}})
        await asyncio.sleep(0.2)  # (the timer fired: committing, its response starting)
        await _event(s, type="input_audio_buffer.append", audio=_b64(_tone(0.3)))
        await asyncio.sleep(0.3)
        await s.response
        await s.close()

    asyncio.run(talk())
    kinds = [e["type"] for e in sent]
    at = kinds.index("input_audio_buffer.timeout_triggered")
    assert kinds[at:at + 4] == ["input_audio_buffer.timeout_triggered", "input_audio_buffer.committed",
                                "conversation.item.added", "conversation.item.done"], kinds
    assert "input_audio_buffer.speech_started" in kinds and kinds.count("response.done") == 1

