"""omni_server/api/telephony.py: G.711 mu-law / A-law against the standard's reference points and
Python's audioop, and the 8 kHz <-> 24 kHz streaming conversion (pieces equal the whole, a tone
keeps its pitch and level)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from omni_server.api import telephony

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import audioop  # (the standard library's G.711, until Python 3.13)
    except ImportError:
        audioop = None


def test_reference_points():
    """Silence and full scale of each law (G.711's tables)."""
    assert telephony.ulaw_decode(bytes([0xFF, 0x7F, 0x00, 0x80])).tolist() == [0, 0, -32124, 32124]
    assert telephony.alaw_decode(bytes([0xD5, 0x55, 0xAA, 0x2A])).tolist() == [8, -8, 32256, -32256]
    assert telephony.ulaw_encode(np.array([0, 32767, -32768], np.int16)) == bytes([0xFF, 0x80, 0x00])
    assert telephony.alaw_encode(np.array([0, 32767, -32768], np.int16)) == bytes([0xD5, 0xAA, 0x2A])


@pytest.mark.skipif(audioop is None, reason="audioop left the standard library in Python 3.13")
def test_every_code_and_sample_as_audioop():
    codes = bytes(range(256))
    everything = np.arange(-32768, 32768, dtype=np.int16)
    for decode, encode, ref_decode, ref_encode in (
            (telephony.ulaw_decode, telephony.ulaw_encode, audioop.ulaw2lin, audioop.lin2ulaw),
            (telephony.alaw_decode, telephony.alaw_encode, audioop.alaw2lin, audioop.lin2alaw)):
        assert decode(codes).tobytes() == ref_decode(codes, 2)
        assert encode(everything) == ref_encode(everything.tobytes(), 2)


def test_codecs_round_trip_within_a_step():
    x = np.linspace(-32000, 32000, 4001).astype(np.int16)
    for decode, encode in telephony.CODECS.values():
        back = decode(encode(x)).astype(np.int32)
        assert (np.abs(back - x) <= np.maximum(16, np.abs(x.astype(np.int32)) // 16)).all()


@pytest.mark.parametrize("up", [True, False])
def test_pieces_equal_the_whole(up):
    x = np.random.default_rng(0).standard_normal(9001).astype(np.float32)
    c = telephony.Converter(up)
    whole = np.concatenate([c.push(x), c.flush()])
    c = telephony.Converter(up)
    parts = np.concatenate([c.push(x[k:k + 317]) for k in range(0, x.size, 317)] + [c.flush()])
    assert whole.shape == parts.shape and np.allclose(whole, parts, atol=1e-5)
    n = x.size * 3 if up else -(-x.size // 3)
    assert whole.size == n  # (the filter's delay dropped at the start, flushed at the end)


def test_a_tone_keeps_its_pitch_and_level_down_and_up():
    """A 440 Hz tone at 24 kHz, down to 8 kHz and back: the same tone (after the filters' delay),
    its level within 1%; a 5 kHz tone (past the telephone band) is filtered out going down."""
    t = np.arange(24000) / 24000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    down = telephony.Converter(up=False)
    low = np.concatenate([down.push(tone), down.flush()])
    up = telephony.Converter(up=True)
    back = np.concatenate([up.push(low), up.flush()])
    assert back.size == tone.size and np.abs(back[1000:23000] - tone[1000:23000]).max() < 0.01
    high = (0.5 * np.sin(2 * np.pi * 5000 * t)).astype(np.float32)
    c = telephony.Converter(up=False)
    assert np.abs(c.push(high)[100:]).max() < 0.02
