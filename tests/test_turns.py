"""Turn detection's level gate (api/turns.py, the Realtime API's server_vad) on generated audio."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np

from omni_server.api.turns import TurnDetector, level_db

RATE = 24000


def _tone(seconds: float, dbfs: float) -> np.ndarray:
    rms = 32768 * 10 ** (dbfs / 20)  # (a sine's RMS is its peak / sqrt 2)
    return (rms * np.sqrt(2) * np.sin(2 * np.pi * 300 * np.arange(int(seconds * RATE)) / RATE)).astype("<i2")


def _quiet(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype="<i2")


def test_a_turn_starts_at_its_speech_and_stops_after_the_silence():
    audio = np.concatenate([_quiet(0.5), _tone(1.0, -20), _quiet(0.7)])
    events = TurnDetector(RATE, silence_ms=500).feed(audio.tobytes())
    assert events == [("started", int(0.5 * RATE)), ("stopped", int(2.0 * RATE))]


def test_pieces_of_any_size_give_the_same_events_as_one_feed():
    audio = np.concatenate([_quiet(0.33), _tone(0.41, -20), _quiet(0.2), _tone(0.3, -20), _quiet(0.9)]).tobytes()
    whole = TurnDetector(RATE, silence_ms=300).feed(audio)
    rng = np.random.default_rng(0)
    detector, events, k = TurnDetector(RATE, silence_ms=300), [], 0
    while k < len(audio):
        n = 2 * int(rng.integers(1, 3000))
        events += detector.feed(audio[k:k + n])
        k += n
    # (a pause shorter than silence_ms keeps the turn open: one turn)
    assert events == whole == [("started", int(0.32 * RATE)), ("stopped", int(1.54 * RATE))]


def test_a_click_is_not_a_turn_and_the_threshold_sets_the_level():
    click = np.concatenate([_quiet(0.1), _tone(0.02, -6), _quiet(0.6)]).tobytes()
    assert TurnDetector(RATE).feed(click) == []
    soft = np.concatenate([_tone(0.5, -40), _quiet(0.6)]).tobytes()
    assert level_db(0.5) == -35 and TurnDetector(RATE, threshold=0.5).feed(soft) == []
    assert TurnDetector(RATE, threshold=0.3).feed(soft) == [("started", 0), ("stopped", int(1.0 * RATE))]


def test_positions_count_from_where_the_detector_joined_and_end_forgets_a_turn():
    d = TurnDetector(RATE, at=1000 * RATE)
    assert d.feed(_tone(0.2, -20).tobytes()) == [("started", 1000 * RATE)]
    d.end()  # (the client committed)
    assert d.feed(_quiet(1.0).tobytes()) == []


def test_a_session_commits_a_turn_longer_than_its_buffer_at_the_buffers_length():
    """Realtime session, server_vad without responses: 2.5 s of speech against a 1 s buffer is
    committed as 1 s turns (the rest goes on as the next turn); silence outside a turn is not kept
    beyond the prefix padding, however long it runs."""
    from omni_server.api.realtime import Session

    sent = []

    async def send(event):
        sent.append(event)

    async def no_chat(body):
        raise AssertionError("no response asked for")

    async def talk():
        s = Session("m", send, no_chat, voices=[], has_audio=False, max_buffer_s=1.0, audio_cap=None)
        await s.receive(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
            "type": "server_vad", "create_response": False, "prefix_padding_ms": 100}}}}}))
        for piece in (_quiet(5.0), _tone(2.5, -20), _quiet(0.6)):
            await s.receive(json.dumps({"type": "input_audio_buffer.append",
                                        "audio": base64.b64encode(piece.tobytes()).decode()}))
            kept = len(s.buffer)
        return s, kept

    s, kept = asyncio.run(talk())
    assert not [e for e in sent if e["type"] == "error"], sent
    kinds = [e["type"] for e in sent if e["type"].startswith("input_audio_buffer.")]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed"] * 2 + ["input_audio_buffer.speech_started",
                                                            "input_audio_buffer.speech_stopped",
                                                            "input_audio_buffer.committed"]
    lengths = [len(s.audio_of[i["id"]]) // 2 for i in s.items]
    # (4.9 s to 5.9 s, 5.9 to 6.9, then 6.9 s to the stop at 7.5 + 0.5 s)
    assert lengths == [RATE, RATE, int(1.1 * RATE)], lengths
    assert kept == 2 * int(0.1 * RATE)  # (after the last turn: 0.1 s of its trailing silence kept as padding)
