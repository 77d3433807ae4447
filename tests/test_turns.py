"""Turn detection's level gate (api/turns.py, the Realtime API's server_vad) on generated audio."""

from __future__ import annotations

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



def test_a_steady_sound_stops_counting_as_speech_and_louder_speech_over_it_does():
    """A hum at -25 dBFS: a turn at first, over within ~14 s as the noise floor rises 5 dB a second
    to 9 dB under it (from -100 dBFS); speech 12 dB above the hum then opens a turn again."""
    hum = _tone(20.0, -25)
    louder = (hum[:RATE].astype(np.int32) + _tone(1.0, -13)).clip(-32768, 32767).astype("<i2")
    events = TurnDetector(RATE).feed(np.concatenate([hum, louder, hum[:RATE]]).tobytes())
    assert [kind for kind, _ in events] == ["started", "stopped", "started", "stopped"], events
    assert events[0][1] == 0 and 13.5 * RATE < events[1][1] < 14 * RATE  # ((100 - 34) dB / 5 dB a s + 0.5 s)
    assert 20 * RATE <= events[2][1] < 20.1 * RATE and 21 * RATE <= events[3][1] <= 21.6 * RATE
