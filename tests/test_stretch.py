"""omni_server/api/stretch.py: speech faster or slower at the same pitch, piece by piece."""

from __future__ import annotations

import numpy as np
import pytest

from omni_server.api.audio import StreamEncoder
from omni_server.api.stretch import TimeStretch

SR = 24000


def _tone(seconds: float, *freqs: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return sum(a * np.sin(2 * np.pi * f * t) for a, f in zip((0.5, 0.2, 0.1), freqs)).astype(np.float32)


def _stretch(x: np.ndarray, speed: float, chunks: list[int] | None = None) -> np.ndarray:
    ts, out, i = TimeStretch(SR, speed), [], 0
    for n in chunks or [x.size]:
        out.append(ts.push(x[i:i + n]))
        i += n
    out.append(ts.flush())
    return np.concatenate(out)


def _peak_hz(w: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(w * np.hanning(w.size)))
    return float(np.fft.rfftfreq(w.size, 1 / SR)[np.argmax(spectrum)])


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.5, 2.0, 4.0])
def test_tempo_changes_and_pitch_stays(speed):
    x = _tone(2.0, 220, 440, 660)
    y = _stretch(x, speed)
    assert y.size == round(x.size / speed)
    assert abs(_peak_hz(y) - 220) < 2  # resampling would put it at 220 * speed
    # the level is kept (frames aligned on the waveform add up, not cancel)
    assert abs(np.abs(y[SR // 10:-SR // 10]).max() / np.abs(x).max() - 1) < 0.05


@pytest.mark.parametrize("speed", [0.5, 2.0, 3.0])
def test_events_move_to_their_time_over_speed(speed):
    """Two 100 ms bursts at 0.5 s and 1.5 s start at 0.5 / speed and 1.5 / speed and last 0.1 / speed,
    to within a frame plus the search tolerance (40 ms: a frame that catches a burst's first
    samples plays them from its own start)."""
    x = np.zeros(2 * SR, np.float32)
    burst = np.sin(2 * np.pi * 300 * np.arange(SR // 10) / SR).astype(np.float32)
    for at in (0.5, 1.5):
        x[int(at * SR):int(at * SR) + burst.size] = burst
    loud = np.flatnonzero(np.abs(_stretch(x, speed)) > 0.05) / SR
    gaps = np.flatnonzero(np.diff(loud) > 0.05)
    assert gaps.size == 1  # two bursts
    starts, ends = [loud[0], loud[gaps[0] + 1]], [loud[gaps[0]], loud[-1]]
    for start, end, at in zip(starts, ends, (0.5, 1.5)):
        assert abs(start - at / speed) < 0.04 and abs((end - start) - 0.1 / speed) < 0.04, (start, end)


@pytest.mark.parametrize("speed", [0.33, 1.7, 3.99])
def test_output_is_the_same_however_the_input_is_split(speed):
    x = _tone(1.5, 180, 360) * np.linspace(0, 1, int(1.5 * SR), dtype=np.float32)
    whole = _stretch(x, speed)
    rng = np.random.default_rng(0)
    chunks = list(rng.integers(1, 4000, size=200))
    assert np.array_equal(_stretch(x, speed, chunks), whole)
    assert np.array_equal(_stretch(x, speed, [1] * 700 + [x.size]), whole)


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 44100])
@pytest.mark.parametrize("speed", [0.25, 0.7, 3.0, 4.0])
def test_length_is_input_over_speed_for_any_length(rate, speed):
    """Also where a frame is ready before len / speed output is due (speeds above ~2.7): the
    pieces handed out never run ahead of it."""
    rng = np.random.default_rng(rate)
    for n in range(1, 3000, 61):
        x = rng.standard_normal(n).astype(np.float32) * 0.1
        ts, total = TimeStretch(rate, speed), 0
        for i in range(0, n, 97):
            total += ts.push(x[i:i + 97]).size
            assert total <= (i + x[i:i + 97].size) / speed
        assert total + ts.flush().size == round(n / speed), n


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0])
def test_level_holds_to_the_end(speed):
    """A steady input comes out steady to its last sample (slowed down, the last frames would
    otherwise reach into the silence after the input and fade the end out)."""
    y = _stretch(np.full(SR, 0.5, np.float32), speed)
    assert np.abs(y - 0.5).max() < 1e-3


def test_speed_one_is_the_input():
    x = _tone(0.5, 200, 410)
    assert np.abs(_stretch(x, 1.0) - x).max() < 1e-6


def test_short_empty_and_silent_inputs():
    assert _stretch(np.zeros(0, np.float32), 2.0).size == 0
    assert _stretch(np.ones(101, np.float32) * 0.1, 0.5).size == 202
    quiet = _stretch(np.zeros(SR, np.float32), 1.3)
    assert quiet.size == round(SR / 1.3) and not quiet.any()
    with pytest.raises(ValueError, match="speed"):
        TimeStretch(SR, 5.0)
    assert np.isfinite(_stretch(np.full(2000, np.nan, np.float32), 0.5)).all()


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac", "mp3"])
def test_encoder_takes_a_one_sample_piece(fmt):
    """(A piece of one sample was a 0-d array after squeeze: flac / mp3 failed on it.)"""
    enc = StreamEncoder(SR, fmt, speed=4.0)
    assert enc.push(np.zeros(3, np.float32)) + enc.close()
    enc = StreamEncoder(SR, fmt)
    assert enc.push(np.zeros(1, np.float32)) + enc.close()


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac"])
def test_encoder_with_speed(fmt):
    import io

    import soundfile as sf

    x = _tone(1.0, 250)
    enc = StreamEncoder(SR, fmt, speed=2.0)
    data = b"".join(enc.push(x[i:i + 4800]) for i in range(0, x.size, 4800)) + enc.close()
    if fmt == "pcm":
        wave = np.frombuffer(data, "<i2").astype(np.float32) / 32768
    else:
        wave, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == SR
    assert wave.size == SR // 2 and abs(_peak_hz(wave) - 250) < 3
