"""OpenAI's Agents SDK (`openai-agents`) as a voice agent's developer runs it against this server's
Realtime endpoint: its session settings taken as sent (semantic_vad, input transcription, its
audio formats), a text message and streamed speech answered in audio."""

from __future__ import annotations

import asyncio

import numpy as np

MODEL = "omni-tiny"


async def _agent(server, max_output_tokens: int):
    """An agent's session with this server: its model, one of its voices, its URL."""
    from agents.realtime import RealtimeAgent, RealtimeRunner

    runner = RealtimeRunner(RealtimeAgent(name="guide", instructions="Be brief."), config={"model_settings": {
        "model_name": MODEL, "voice": "Chelsie", "max_output_tokens": max_output_tokens}})
    ws = server.base_url.replace("http://", "ws://")
    return await runner.run(model_config={"url": f"{ws}/v1/realtime?model={MODEL}", "api_key": "x"})


async def _session_events(server, send) -> tuple[list[str], list[dict], list]:
    """One agent session: `send(session)` says something, then events up to the agent's turn end.
    Returns the SDK's event types, the server's raw events and the history at the end."""
    session = await _agent(server, 8)
    kinds, raw, history = [], [], []
    async with session:
        await send(session)
        async for event in session:
            kinds.append(event.type)
            if event.type == "raw_model_event" and event.data.type == "raw_server_event":
                raw.append(event.data.data)
            elif event.type == "history_updated":
                history = event.history
            # (a committed turn's input transcript may land after the reply's end)
            heard = {e["type"] for e in raw} & {"input_audio_buffer.committed",
                                                "conversation.item.input_audio_transcription.completed"}
            if event.type == "error" or ("agent_end" in kinds and len(heard) != 1):
                break
        return kinds, raw, history


def _check_answered(kinds: list[str], raw: list[dict]) -> None:
    assert "error" not in kinds and not [e for e in raw if e["type"] == "error"], [e for e in raw if e["type"] == "error"]
    (updated, *_) = [e["session"] for e in raw if e["type"] == "session.updated"]
    # The SDK's own defaults, taken: semantic_vad, input transcription, PCM16 at 24 kHz both ways.
    assert updated["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert updated["audio"]["input"]["transcription"] is not None and updated["instructions"] == "Be brief."
    assert updated["audio"]["output"]["voice"] == "Chelsie"
    assert kinds.count("audio") > 0 and "agent_end" in kinds
    (done,) = [e for e in raw if e["type"] == "response.done"]
    assert done["response"]["status"] in ("completed", "incomplete") and done["response"]["usage"]["output_tokens"] > 0


def test_an_agent_answers_a_text_message_in_audio(speech_server):
    async def send(session):
        await session.send_message("Hello")

    kinds, raw, history = asyncio.run(asyncio.wait_for(_session_events(speech_server, send), 180))
    _check_answered(kinds, raw)
    assert [(i.type, i.role) for i in history][:2] == [("message", "user"), ("message", "assistant")]


def test_an_agent_hears_a_turn_in_streamed_audio_and_answers_it(speech_server):
    """Speech at 0.5-1.5 s, streamed in 100 ms pieces: semantic_vad (eagerness auto: 800 ms of
    silence) finds the turn 200-2300 ms (300 ms of padding), commits it, answers it, and the SDK's
    input transcription transcribes it."""
    tone = (0.3 * np.sin(2 * np.pi * 330 * np.arange(24000) / 24000) * 32767).astype("<i2")
    pcm = np.concatenate([np.zeros(12000, "<i2"), tone, np.zeros(36000, "<i2")]).tobytes()

    async def send(session):
        for k in range(0, len(pcm), 4800):
            await session.send_audio(pcm[k:k + 4800])

    kinds, raw, history = asyncio.run(asyncio.wait_for(_session_events(speech_server, send), 180))
    _check_answered(kinds, raw)
    (started,) = [e for e in raw if e["type"] == "input_audio_buffer.speech_started"]
    (stopped,) = [e for e in raw if e["type"] == "input_audio_buffer.speech_stopped"]
    assert (started["audio_start_ms"], stopped["audio_end_ms"]) == (200, 2300)
    (heard,) = [e for e in raw if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert heard["item_id"] == started["item_id"] and isinstance(heard["transcript"], str)


def test_an_agent_interrupted_as_it_speaks_goes_on_to_the_next_message(speech_server):
    """session.interrupt() at the reply's first audio (a barge-in: the SDK truncates the playing
    item, the reply most likely still being made) is taken without an error, and the next message
    is answered."""
    async def talk():
        session = await _agent(speech_server, 60)
        raw, ends, interrupted = [], 0, False
        async with session:
            await session.send_message("Tell a long story")
            async for event in session:
                if event.type == "raw_model_event" and event.data.type == "raw_server_event":
                    raw.append(event.data.data)
                if event.type == "audio" and not interrupted:
                    interrupted = True
                    await session.interrupt()
                if event.type == "error":
                    break
                if event.type == "agent_end":
                    ends += 1
                    if ends == 2:
                        break
                    await session.send_message("Hello again")
        return raw

    raw = asyncio.run(asyncio.wait_for(talk(), 180))
    assert not [e for e in raw if e["type"] == "error"], [e for e in raw if e["type"] == "error"]
    (truncated,) = [e for e in raw if e["type"] == "conversation.item.truncated"]
    first, second = [e["response"] for e in raw if e["type"] == "response.done"]
    assert truncated["item_id"] == first["output"][0]["id"] and first["status"] in ("cancelled", "completed", "incomplete")
    assert second["status"] in ("completed", "incomplete") and second["usage"]["output_tokens"] > 0
