"""Telephone audio (G.711 at 8 kHz: mu-law and A-law, the Realtime API's `audio/pcmu` and
`audio/pcma`): the codecs, and a streaming 8 kHz <-> 24 kHz conversion so that a call's audio joins
a session's 24 kHz PCM16 and its replies leave as the caller's format.

The codecs are G.711's segment-and-mantissa companding, on whole arrays. The conversion is a
windowed-sinc low-pass FIR (cutoff 3.6 kHz, below the telephone band's Nyquist) run at 24 kHz,
upsampling by zero-stuffing (x3 gain) and downsampling by keeping every third sample; it carries
its last inputs from piece to piece, so a stream converted in pieces equals the whole converted
at once, and drops the filter's delay (`DELAY` samples at 24 kHz, 1 ms) from the stream's start:
the output lines up with the input, its last millisecond out at `flush`.
"""

from __future__ import annotations

import numpy as np

FACTOR = 3  # 24 kHz / 8 kHz
_TAPS = 49
DELAY = (_TAPS - 1) // 2  # (a multiple of FACTOR: the 8 kHz samples line up with every third 24 kHz one)
_n = np.arange(_TAPS) - DELAY
_FIR = (np.sinc(2 * 3600 / 24000 * _n) * 2 * 3600 / 24000 * np.hamming(_TAPS)).astype(np.float32)
_FIR /= _FIR.sum()  # (unit gain at DC)

_U_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_A_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def ulaw_decode(data: bytes) -> np.ndarray:
    """mu-law bytes -> int16 samples."""
    u = ~np.frombuffer(data, np.uint8).astype(np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def ulaw_encode(samples: np.ndarray) -> bytes:
    """int16 samples -> mu-law bytes."""
    x = np.asarray(samples, np.int32) >> 2
    mask = np.where(x < 0, 0x7F, 0xFF)
    x = np.minimum(np.abs(x), 8159) + 0x21
    seg = np.searchsorted(_U_SEGMENT_ENDS, x)  # (the first segment whose end is >= x)
    u = np.where(seg >= 8, 0x7F, (seg << 4) | ((x >> (seg + 1)) & 0x0F))
    return ((u ^ mask) & 0xFF).astype(np.uint8).tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes -> int16 samples."""
    a = np.frombuffer(data, np.uint8).astype(np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, t, -t).astype(np.int16)


def alaw_encode(samples: np.ndarray) -> bytes:
    """int16 samples -> A-law bytes."""
    x = np.asarray(samples, np.int32) >> 3
    mask = np.where(x >= 0, 0xD5, 0x55)
    x = np.where(x >= 0, x, -x - 1)
    seg = np.searchsorted(_A_SEGMENT_ENDS, x)
    a = np.where(seg >= 8, 0x7F, (seg << 4) | (np.where(seg < 2, x >> 1, x >> seg) & 0x0F))
    return ((a ^ mask) & 0xFF).astype(np.uint8).tobytes()


CODECS = {"audio/pcmu": (ulaw_decode, ulaw_encode), "audio/pcma": (alaw_decode, alaw_encode)}


class Converter:
    """8 kHz -> 24 kHz (`up`) or 24 kHz -> 8 kHz (down), float samples, piece by piece."""

    def __init__(self, up: bool):
        self.up = up
        self.history = np.zeros(_TAPS - 1, np.float32)  # (the last 24 kHz inputs the filter still reads)
        self.phase = 0  # (down: the 24 kHz samples to skip before the next kept one)
        self.skip = DELAY if up else DELAY // FACTOR  # (the filter's delay, at the output rate: dropped)

    def push(self, samples: np.ndarray) -> np.ndarray:
        x = np.asarray(samples, np.float32).reshape(-1)
        if self.up:
            stuffed = np.zeros(x.size * FACTOR, np.float32)
            stuffed[::FACTOR] = x * FACTOR
            x = stuffed
        if x.size == 0:
            return x
        padded = np.concatenate([self.history, x])
        y = np.convolve(padded, _FIR, mode="valid")  # (one output per new input)
        self.history = padded[-(_TAPS - 1):]
        if not self.up:
            kept = y[self.phase::FACTOR]
            self.phase = (self.phase - y.size) % FACTOR
            y = kept
        n = min(self.skip, y.size)
        self.skip -= n
        return y[n:]

    def flush(self) -> np.ndarray:
        """What the filter still holds (its `DELAY` at 24 kHz), as if the stream went on in silence."""
        return self.push(np.zeros(-(-DELAY // FACTOR) if self.up else DELAY, np.float32))
