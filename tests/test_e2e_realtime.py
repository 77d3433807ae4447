"""OpenAI's Realtime API (`/v1/realtime`) through the official `openai` client's `realtime.connect`
against the embedded default pipeline: a response is the chat turn of the conversation so far, so
its transcript, text and prompt equal /v1/chat/completions' for the same messages (greedy)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import numpy as np
import openai
import pytest

MODEL = "omni-tiny"
PCM = (0.3 * np.sin(2 * np.pi * 330 * np.arange(24000) / 24000) * 32767).astype("<i2").tobytes()  # 1 s, 24 kHz


def _wav_b64(pcm: bytes) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24000), w.writeframes(pcm)
    return base64.b64encode(buf.getvalue()).decode()


def _connect(server, model: str = MODEL):
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    return client.realtime.connect(model=model)


async def _until(conn, kind: str, seen: list | None = None, timeout: float = 120):
    """Events up to the first of type `kind` (returned); the others appended to `seen` (an error
    event fails the test unless it is the one awaited)."""
    async def wait():
        async for ev in conn:
            if ev.type == kind:
                return ev
            assert ev.type != "error", ev.error
            if seen is not None:
                seen.append(ev)
    return await asyncio.wait_for(wait(), timeout)


async def _manual_turns(conn) -> None:
    """Turn detection off: the client ends each turn (commit, response.create)."""
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    assert (await _until(conn, "session.updated")).session.audio.input.turn_detection is None


async def _response(conn, **response) -> tuple[object, str, bytes, list]:
    """response.create, then its events to response.done: (done, text or transcript, PCM16, events)."""
    await conn.response.create(response=response)
    events: list = []
    done = await _until(conn, "response.done", events)
    text = "".join(e.delta for e in events if e.type in ("response.output_text.delta",
                                                          "response.output_audio_transcript.delta"))
    pcm = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    return done, text, pcm, events


def _chat(server, messages: list, spoken: bool, max_tokens: int):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    extra = {"modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm"}} if spoken else \
        {"modalities": ["text"]}
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens,
                                          **extra)


def test_a_spoken_then_a_written_turn_equal_the_chat_turns(speech_server):
    """Audio committed from the input buffer, a spoken reply (transcript and 24 kHz PCM16 as they
    come, the item kept in the conversation), then a text item and a written reply: each equals the
    greedy chat completion of the same messages (the first reply back as its transcript)."""
    async def talk():
        async with _connect(speech_server) as conn:
            created = await _until(conn, "session.created")
            assert created.session.audio.output.voice == "Chelsie"
            assert created.session.audio.input.turn_detection.type == "server_vad"  # (OpenAI's default)
            await conn.send_raw(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "temperature": 0, "audio": {"input": {"turn_detection": None}}}}))
            updated = await _until(conn, "session.updated")
            assert updated.session.model_extra["temperature"] == 0
            for k in range(0, len(PCM), 9600):  # (in pieces of 200 ms)
                await conn.input_audio_buffer.append(audio=base64.b64encode(PCM[k:k + 9600]).decode())
            await conn.input_audio_buffer.commit()
            committed = await _until(conn, "input_audio_buffer.committed")
            spoken = await _response(conn, max_output_tokens=10)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "And then?"}]})
            written = await _response(conn, output_modalities=["text"], max_output_tokens=6)
            return committed, spoken, written

    committed, (done, transcript, pcm, events), (done2, text, pcm2, events2) = asyncio.run(talk())
    assert committed.item_id and done.response.status in ("completed", "incomplete")
    heard = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": _wav_b64(PCM), "format": "wav"}}]}]
    chat = _chat(speech_server, heard, spoken=True, max_tokens=10)
    assert transcript == chat.choices[0].message.audio.transcript and transcript
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens
    assert done.response.usage.output_tokens == chat.usage.completion_tokens
    # The same talker codes (greedy): as much audio, in several deltas as it is made (waveforms
    # differ: token2wav draws its noise per request).
    assert len(pcm) == len(base64.b64decode(chat.choices[0].message.audio.data)) > 0
    assert sum(e.type == "response.output_audio.delta" for e in events) > 1
    item = done.response.output[0]
    assert item.role == "assistant" and item.content[0].type == "output_audio" and item.content[0].transcript == transcript
    kinds = [e.type for e in events]
    assert kinds[:2] == ["conversation.item.added", "conversation.item.done"]  # (the committed audio's item)
    kinds = kinds[2:]
    assert kinds[:4] == ["response.created", "response.output_item.added", "conversation.item.added",
                         "response.content_part.added"]
    assert kinds[-5:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done", "conversation.item.done"]

    chat2 = _chat(speech_server, heard + [{"role": "assistant", "content": transcript},
                                          {"role": "user", "content": "And then?"}], spoken=False, max_tokens=6)
    assert text == chat2.choices[0].message.content and not pcm2
    assert done2.response.usage.input_tokens == chat2.usage.prompt_tokens
    assert done2.response.output[0].content[0].type == "output_text"
    assert "response.output_text.done" in [e.type for e in events2]


def test_a_cancelled_response_ends_and_the_session_goes_on(speech_server):
    """response.cancel mid-speech: response.done says cancelled with what was said so far, the
    pipeline request is dropped in every stage, and the next response runs."""
    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Tell a long story."}]})
            await conn.send_raw(json.dumps({"type": "response.create", "response": {"max_output_tokens": 1000}}))
            await _until(conn, "response.output_audio.delta")
            await conn.response.cancel()
            cancelled = await _until(conn, "response.done")
            await asyncio.sleep(1)
            busy = [speech_server.stats(s)["request_ids"] for s in range(3)]
            again = await _response(conn, output_modalities=["text"], max_output_tokens=4)
            return cancelled, busy, again

    cancelled, busy, (done, text, _, _) = asyncio.run(talk())
    assert cancelled.response.status == "cancelled"
    assert cancelled.response.output[0].status == "incomplete"
    assert busy == [[], [], []]
    assert done.response.status in ("completed", "incomplete") and text


def test_bad_events_get_error_events_and_the_session_goes_on(speech_server):
    async def talk():
        errors = []
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            for raw in ("{not json", json.dumps({"type": "no.such.event"}),
                        json.dumps({"type": "session.update", "event_id": "ev1", "session": {
                            "type": "realtime", "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}}}),
                        json.dumps({"type": "input_audio_buffer.commit"}),
                        json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}),
                        json.dumps({"type": "response.create"}),
                        json.dumps({"type": "session.update", "session": {"audio": {"output": {"voice": "Nobody"}}}}),
                        json.dumps({"type": "session.update", "session": {"output_modalities": ["text", "audio"]}})):
                await conn.send_raw(raw)
                errors.append(await _until(conn, "error"))
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hi"}]})
            await conn.send_raw(json.dumps({"type": "response.create", "response": {"max_output_tokens": 200}}))
            await conn.send_raw(json.dumps({"type": "response.create"}))
            errors.append(await _until(conn, "error"))
            await _until(conn, "response.done")
        return errors

    errors = asyncio.run(talk())
    codes = [e.error.code for e in errors]
    assert codes == ["invalid_json", "unsupported_event", "invalid_value", "input_audio_buffer_commit_empty",
                     "invalid_value", "conversation_empty", "invalid_value", "invalid_value",
                     "conversation_already_has_active_response"], codes
    assert errors[2].error.event_id == "ev1" and errors[2].error.param == "session.audio.input.turn_detection.eagerness"
    assert "Nobody" in errors[6].error.message


def test_another_model_is_refused(speech_server):
    async def talk():
        async with _connect(speech_server, model="gpt-realtime") as conn:
            return await _until(conn, "error")

    err = asyncio.run(talk())
    assert err.error.code == "model_not_found" and "omni-tiny" in err.error.message


def test_audio_past_the_pipelines_cap_is_read_by_the_sessions_own_transcript(speech_server):
    """The default pipeline hears one audio input a prompt and the session asks for no input
    transcription: after two committed turns the response hears the latest and reads the earlier one
    by a transcript the session made itself (unannounced: no transcription events), the one
    /v1/audio/transcriptions gives; deleting an item twice is item_not_found the second time."""
    second = (0.3 * np.sin(2 * np.pi * 523 * np.arange(12000) / 24000) * 32767).astype("<i2").tobytes()

    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await _manual_turns(conn)
            ids, events = [], []
            for pcm in (PCM, second):
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
                await conn.input_audio_buffer.commit()
                ids.append((await _until(conn, "input_audio_buffer.committed", events)).item_id)
            done, text, _, more = await _response(conn, output_modalities=["text"], max_output_tokens=5,
                                                  temperature=0)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "x"}]})
            await conn.conversation.item.delete(item_id=ids[0])
            await _until(conn, "conversation.item.deleted", events)
            await conn.conversation.item.delete(item_id=ids[0])
            again = await _until(conn, "error")
            return done, text, events + more, again

    done, text, events, again = asyncio.run(talk())
    assert not [e.type for e in events if "transcription" in e.type]
    assert again.error.code == "item_not_found"
    client = openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    words = client.audio.transcriptions.create(model=MODEL, file=("a.wav", base64.b64decode(_wav_b64(PCM)),
                                                                  "audio/wav")).text
    chat = _chat(speech_server, [{"role": "user", "content": [{"type": "text", "text": words}]},
                                 {"role": "user", "content": [{"type": "input_audio", "input_audio": {
                                     "data": _wav_b64(second), "format": "wav"}}]}], spoken=False, max_tokens=5)
    assert done.response.status in ("completed", "incomplete")
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens and text == chat.choices[0].message.content


def test_transcribed_audio_items_stand_in_by_their_transcripts_past_the_cap(speech_server):
    """Input transcription on: each committed turn is transcribed as /v1/audio/transcriptions would
    (the same greedy text); with two turns on a pipeline hearing one clip a prompt, the response
    hears the latest and reads the earlier one's transcript: the chat of those messages."""
    second = (0.3 * np.sin(2 * np.pi * 523 * np.arange(12000) / 24000) * 32767).astype("<i2").tobytes()

    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "transcription": {"model": "whisper-1", "language": "en"}, "turn_detection": None}}})
            updated = await _until(conn, "session.updated")
            heard = []
            for pcm in (PCM, second):
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
                await conn.input_audio_buffer.commit()
                heard.append(await _until(conn, "conversation.item.input_audio_transcription.completed"))
            await conn.send_raw(json.dumps({"type": "response.create", "response": {
                "output_modalities": ["text"], "max_output_tokens": 5, "temperature": 0}}))
            done = await _until(conn, "response.done")
            return updated, heard, done

    updated, heard, done = asyncio.run(talk())
    assert updated.session.audio.input.transcription.language == "en"
    client = openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    for event, pcm in zip(heard, (PCM, second)):
        wav = base64.b64decode(_wav_b64(pcm))
        assert event.transcript == client.audio.transcriptions.create(
            model=MODEL, file=("a.wav", wav, "audio/wav"), language="en").text
    chat = _chat(speech_server, [{"role": "user", "content": [{"type": "text", "text": heard[0].transcript}]},
                                 {"role": "user", "content": [{"type": "input_audio", "input_audio": {
                                     "data": _wav_b64(second), "format": "wav"}}]}], spoken=False, max_tokens=5)
    assert done.response.status in ("completed", "incomplete")
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens
    assert done.response.output[0].content[0].text == chat.choices[0].message.content


QUIET = bytes(2 * 12000)  # 0.5 s of silence


@pytest.mark.parametrize("detection, start_ms, stop_ms", [
    ({"type": "server_vad", "prefix_padding_ms": 200, "silence_duration_ms": 400}, 300, 1900),
    ({"type": "semantic_vad", "eagerness": "high"}, 200, 2000),  # (padding 300 ms, silence 500 ms)
], ids=["server_vad", "semantic_vad"])
def test_turn_detection_commits_a_spoken_turn_and_answers_it(speech_server, detection, start_ms, stop_ms):
    """Silence, a 1 s tone (0.5-1.5 s), silence, appended in 100 ms pieces: speech starts at the
    tone less the prefix padding, stops the turn's silence after it, and that span is committed and
    answered: the greedy chat of exactly that audio."""
    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
                "input": {"turn_detection": detection}}})
            await conn.send_raw(json.dumps({"type": "session.update", "session": {"temperature": 0,
                                                                                  "max_output_tokens": 5}}))
            await _until(conn, "session.updated")
            audio = QUIET + PCM + QUIET + QUIET
            events = []
            for k in range(0, len(audio), 4800):
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[k:k + 4800]).decode())
            done = await _until(conn, "response.done", events)
            return events, done

    events, done = asyncio.run(talk())
    kinds = [e.type for e in events]
    assert kinds[:5] == ["session.updated", "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "conversation.item.added"], kinds
    started, stopped, committed = events[1], events[2], events[3]
    assert (started.audio_start_ms, stopped.audio_end_ms) == (start_ms, stop_ms)
    assert started.item_id == stopped.item_id == committed.item_id
    assert "response.created" in kinds and done.response.status in ("completed", "incomplete")
    turn = (QUIET + PCM + QUIET + QUIET)[2 * start_ms * 24:2 * stop_ms * 24]  # (24 samples a ms)
    chat = _chat(speech_server, [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": _wav_b64(turn), "format": "wav"}}]}], spoken=False, max_tokens=5)
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens
    assert done.response.output[0].content[0].text == chat.choices[0].message.content


def test_speech_cuts_off_a_spoken_reply_and_truncate_trims_what_was_not_heard(speech_server):
    """A spoken reply under way when the user speaks again: response.done `cancelled` by
    `turn_detected`; the new turn is committed and answered. conversation.item.truncate to 0 ms
    leaves the cut reply empty, so the next response's prompt is the chat with an empty assistant turn."""
    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await conn.send_raw(json.dumps({"type": "session.update", "session": {"temperature": 0}}))
            await _until(conn, "session.updated")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Tell a long story."}]})
            await conn.send_raw(json.dumps({"type": "response.create", "response": {"max_output_tokens": 1000}}))
            await _until(conn, "response.output_audio.delta")
            for piece in (PCM, QUIET, QUIET):
                await conn.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
            events = []  # (the turn's, the cut reply's and the answer's)
            cut = await _until(conn, "response.done", events)
            answer = await _until(conn, "response.done", events)
            await conn.conversation.item.truncate(item_id=cut.response.output[0].id, content_index=0,
                                                  audio_end_ms=10 ** 9)
            too_far = await _until(conn, "error")
            await conn.conversation.item.truncate(item_id=cut.response.output[0].id, content_index=0, audio_end_ms=0)
            truncated = await _until(conn, "conversation.item.truncated")
            await conn.conversation.item.delete(item_id=answer.response.output[0].id)
            await _until(conn, "conversation.item.deleted")
            again = await _response(conn, output_modalities=["text"], max_output_tokens=3)
            return cut, events, answer, too_far, truncated, again

    cut, events, answer, too_far, truncated, (done, text, _, _) = asyncio.run(talk())
    assert cut.response.status == "cancelled" and cut.response.status_details.reason == "turn_detected"
    kinds = [e.type for e in events]
    assert "input_audio_buffer.committed" in kinds and "response.created" in kinds
    started, stopped = (next(e for e in events if e.type == f"input_audio_buffer.speech_{k}") for k in ("started", "stopped"))
    assert (started.audio_start_ms, stopped.audio_end_ms) == (0, 1500), kinds  # (the tone; its 500 ms of silence)
    assert answer.response.status in ("completed", "incomplete")
    assert too_far.error.param == "audio_end_ms" and truncated.audio_end_ms == 0
    turn = PCM + QUIET  # (no audio before it to pad with; its silence up to the stop)
    heard = {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": _wav_b64(turn), "format": "wav"}}]}
    chat = _chat(speech_server, [{"role": "user", "content": [{"type": "text", "text": "Tell a long story."}]},
                                 {"role": "assistant", "content": ""}, heard], spoken=False, max_tokens=3)
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens, [
        (e.type, getattr(e, "item_id", None), getattr(e, "previous_item_id", None)) for e in events]
    assert text == chat.choices[0].message.content


def test_a_conversation_past_the_context_leaves_out_its_oldest_items(speech_server):
    """Six long text turns (~2,400 tokens) against a 2,048-token context: with truncation `auto`
    (the default) the response's prompt is the chat of the latest items that fit; with `disabled`
    response.create is an error (context_length_exceeded)."""
    turns = [" ".join(f"w{k}x{j}" for j in range(130)) for k in range(6)]  # (~400 tokens each)

    async def talk():
        async with _connect(speech_server) as conn:
            created = await _until(conn, "session.created")
            for text in turns:
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})
            await conn.send_raw(json.dumps({"type": "session.update", "session": {"truncation": "disabled"}}))
            await _until(conn, "session.updated")
            await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 3})
            refused = await _until(conn, "error")
            await conn.send_raw(json.dumps({"type": "session.update", "session": {"truncation": "auto",
                                                                                  "temperature": 0}}))
            await _until(conn, "session.updated")
            done, text, _, _ = await _response(conn, output_modalities=["text"], max_output_tokens=3)
            return created, refused, done, text

    created, refused, done, text = asyncio.run(talk())
    assert created.session.truncation == "auto"
    assert refused.error.code == "context_length_exceeded"
    fits = None
    for skip in range(1, 6):
        chat_messages = [{"role": "user", "content": [{"type": "text", "text": t}]} for t in turns[skip:]]
        try:
            chat = _chat(speech_server, chat_messages, spoken=False, max_tokens=3)
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded"
            continue
        fits = skip
        break
    assert fits is not None and fits < 5
    assert done.response.status in ("completed", "incomplete")
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens and text == chat.choices[0].message.content


def test_media_tokens_past_the_context_truncate_too_and_max_output_tokens_is_a_ceiling(speech_server):
    """The api counts an audio clip as one placeholder, the thinker as its tokens (~25 a second): a
    ~1,700-token text item then a 20 s clip fit the api's count of a 2,048-token context but not
    the thinker's. With truncation auto the response leaves the text item out (the chat of the clip
    alone); disabled, it fails with context_length_exceeded. max_output_tokens 4096 (more than the
    context) caps a reply, it does not refuse it."""
    words = " ".join(["hello"] * 800)  # (~1,700 tokens)
    clip = (0.3 * np.sin(2 * np.pi * 440 * np.arange(20 * 24000) / 24000) * 32767).astype("<i2").tobytes()

    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await conn.send_raw(json.dumps({"type": "session.update", "session": {
                "temperature": 0, "truncation": "disabled", "audio": {"input": {"turn_detection": None}}}}))
            await _until(conn, "session.updated")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": words}]})
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": base64.b64encode(clip).decode()}]})
            refused, _, _, _ = await _response(conn, output_modalities=["text"], max_output_tokens=3)
            await conn.send_raw(json.dumps({"type": "session.update", "session": {"truncation": "auto",
                                                                                  "max_output_tokens": 4096}}))
            await _until(conn, "session.updated")
            done, text, _, _ = await _response(conn, output_modalities=["text"])
            return refused, done, text

    refused, done, text = asyncio.run(talk())
    assert refused.response.status == "failed"
    assert refused.response.status_details.error.code == "context_length_exceeded"
    assert done.response.status in ("completed", "incomplete"), done.response.status_details
    chat = _chat(speech_server, [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": _wav_b64(clip), "format": "wav"}}]}], spoken=False, max_tokens=done.response.usage.output_tokens)
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens
    assert text == chat.choices[0].message.content


def test_output_speed_and_the_idle_timeout(speech_server):
    """audio.output.speed 1.5: the spoken reply is the chat's audio in 1 / 1.5 of its samples.
    server_vad's idle_timeout_ms: with nothing said after that reply's audio has played, the
    server says input_audio_buffer.timeout_triggered, commits the (empty: 100 ms of silence) buffer
    as the user's turn and answers the conversation with it."""
    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await conn.send_raw(json.dumps({"type": "session.update", "session": {
                "temperature": 0, "max_output_tokens": 8, "audio": {
                    "output": {"speed": 1.5}, "input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 300}}}}}))
            updated = await _until(conn, "session.updated")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Say something."}]})
            first = await _response(conn, max_output_tokens=8)
            events: list = []
            timeout = await _until(conn, "input_audio_buffer.timeout_triggered", events)
            assert not events  # (nothing between the reply and the timeout)
            answer = await _until(conn, "response.done", events)
            return updated, first, timeout, events, answer

    updated, (done, transcript, pcm, _), timeout, events, answer = asyncio.run(talk())
    assert updated.session.audio.output.speed == 1.5
    assert updated.session.audio.input.turn_detection.idle_timeout_ms == 300
    asked = [{"role": "user", "content": "Say something."}]
    chat = _chat(speech_server, asked, spoken=True, max_tokens=8)
    assert transcript == chat.choices[0].message.audio.transcript
    assert len(pcm) // 2 == round(len(base64.b64decode(chat.choices[0].message.audio.data)) // 2 / 1.5) > 0
    committed = next(e for e in events if e.type == "input_audio_buffer.committed")
    assert committed.item_id == timeout.item_id and timeout.audio_end_ms >= timeout.audio_start_ms == 0
    silence = {"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": _wav_b64(bytes(2 * 2400)), "format": "wav"}}]}
    chat2 = _chat(speech_server, asked + [{"role": "assistant", "content": transcript}, silence], spoken=False,
                  max_tokens=1)
    assert answer.response.status in ("completed", "incomplete")
    assert answer.response.usage.input_tokens == chat2.usage.prompt_tokens


def test_an_image_item_is_seen_as_the_chats_image(speech_server):
    """A user item with an input_image (a data: URL) and text: the written reply equals the greedy
    chat of the same picture and words; an undecodable image is refused at create."""
    from PIL import Image

    rgb = np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await conn.send_raw(json.dumps({"type": "session.update", "session": {"temperature": 0}}))
            await _until(conn, "session.updated")
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]})
            refused = await _until(conn, "error")
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is this?"}]})
            return refused, await _response(conn, output_modalities=["text"], max_output_tokens=5)

    refused, (done, text, _, _) = asyncio.run(talk())
    assert refused.error.param == "item.content[0].image_url"
    chat = _chat(speech_server, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}],
        spoken=False, max_tokens=5)
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens > 20
    assert text == chat.choices[0].message.content


def test_a_transcription_session_transcribes_detected_turns(speech_server):
    """`intent=transcription`: silence, a 1 s tone, silence; the detected turn is committed and its
    transcript (deltas, then completed) equals /v1/audio/transcriptions of exactly that audio; a
    response.create is refused and the session goes on."""
    client = openai.AsyncOpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0)

    async def talk():
        async with client.realtime.connect(model=MODEL, extra_query={"intent": "transcription"}) as conn:
            created = await _until(conn, "session.created")
            await conn.session.update(session={"type": "transcription",
                                               "include": ["item.input_audio_transcription.logprobs"]})
            await _until(conn, "session.updated")
            await conn.response.create()
            refused = await _until(conn, "error")
            audio = QUIET + PCM + QUIET + QUIET
            for k in range(0, len(audio), 4800):
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[k:k + 4800]).decode())
            events: list = []
            done = await _until(conn, "conversation.item.input_audio_transcription.completed", events)
            return created, refused, events, done

    created, refused, events, done = asyncio.run(talk())
    assert created.session.type == "transcription" and refused.error.code == "unsupported_event"
    committed = next(e for e in events if e.type == "input_audio_buffer.committed")
    deltas = [e.delta for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
    assert done.item_id == committed.item_id and "".join(deltas) == done.transcript and len(deltas) > 1
    turn = (QUIET + PCM + QUIET)[2 * 4800:2 * 48000]  # (0.2 s to 2.0 s: 300 ms padding, 500 ms of silence)
    sync = openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    wav = io.BytesIO(base64.b64decode(_wav_b64(turn)))
    assert done.transcript == sync.audio.transcriptions.create(model=MODEL, file=("turn.wav", wav)).text
    assert done.usage.input_tokens > 0
    # (include: each token's log-probability, the deltas' the first of the completed's)
    assert len(done.logprobs) == done.usage.output_tokens and all(p.logprob <= 0 for p in done.logprobs)
    assert [p for e in events if e.type.endswith("transcription.delta") for p in e.logprobs] == \
        done.logprobs[:sum(len(e.logprobs) for e in events if e.type.endswith("transcription.delta"))]


def test_an_out_of_band_response_reads_its_own_input(speech_server):
    """response.create with conversation none and its own `input` (a reference to a conversation
    item and a new text item): the greedy chat of exactly those messages; the conversation is left
    as it was."""
    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await conn.send_raw(json.dumps({"type": "session.update", "session": {
                "temperature": 0, "instructions": "Be brief."}}))
            await _until(conn, "session.updated")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hello there."}]})
            first = (await _until(conn, "conversation.item.done")).item.id
            got = await _response(conn, conversation="none", output_modalities=["text"], max_output_tokens=4,
                                  input=[{"type": "item_reference", "id": first},
                                         {"type": "message", "role": "user",
                                          "content": [{"type": "input_text", "text": "Is it spam?"}]}])
            return got

    done, text, _, events = asyncio.run(talk())
    assert done.response.conversation_id is None and "conversation.item.added" not in [e.type for e in events]
    chat = _chat(speech_server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."},
                                 {"role": "user", "content": "Is it spam?"}], spoken=False, max_tokens=4)
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens
    assert text == chat.choices[0].message.content


def test_a_telephone_call_in_mu_law(speech_server):
    """Input and output audio/pcmu (G.711 mu-law at 8 kHz): the committed call audio is heard as
    its 24 kHz conversion (the reply is the greedy chat of that audio) and the spoken reply comes
    as mu-law, one byte for each three of the chat's 24 kHz samples."""
    from omni_server.api import telephony
    from omni_server.api.realtime import encode

    law = telephony.ulaw_encode((8000 * np.sin(2 * np.pi * 300 * np.arange(8000) / 8000)).astype(np.int16))

    async def talk():
        async with _connect(speech_server) as conn:
            await _until(conn, "session.created")
            await conn.send_raw(json.dumps({"type": "session.update", "session": {"temperature": 0, "audio": {
                "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                "output": {"format": {"type": "audio/pcmu"}}}}}))
            await _until(conn, "session.updated")
            for k in range(0, len(law), 1600):
                await conn.input_audio_buffer.append(audio=base64.b64encode(law[k:k + 1600]).decode())
            await conn.input_audio_buffer.commit()
            return await _response(conn, max_output_tokens=8)

    done, transcript, said, _ = asyncio.run(talk())
    conv = telephony.Converter(up=True)
    heard = b"".join(encode.heard(law[k:k + 1600], "audio/pcmu", conv) for k in range(0, len(law), 1600))
    chat = _chat(speech_server, [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": _wav_b64(heard), "format": "wav"}}]}], spoken=True, max_tokens=8)
    assert done.response.audio.output.format.type == "audio/pcmu"
    assert done.response.usage.input_tokens == chat.usage.prompt_tokens
    assert transcript == chat.choices[0].message.audio.transcript
    samples = len(base64.b64decode(chat.choices[0].message.audio.data)) // 2
    assert len(said) == -(-samples // 3) > 0
