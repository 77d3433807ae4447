"""The Realtime API's media as a session sends and keeps it: 24 kHz PCM16 audio (a reply's waveform
pieces converted, a user item's audio as WAV for the chat path) and images seen at `detail: low`."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np

from omni_server.api import audio
from omni_server.api.stretch import TimeStretch

RATE = 24000  # the Realtime API's PCM rate, in and out
FORMAT = {"type": "audio/pcm", "rate": RATE}
LOW_DETAIL = 512  # an image with `detail: low` is seen within this many pixels a side (OpenAI's low)


def wav_b64(pcm: bytes) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return base64.b64encode(buf.getvalue()).decode()


def pcm16(piece, rate: int, stretch: TimeStretch | None = None) -> bytes:
    """A waveform piece as 24 kHz little-endian PCM16 (resampled per piece if the vocoder's rate
    differs), through the output speed's time-stretch when there is one."""
    samples = audio._to_numpy(piece)
    if rate != RATE:
        samples = audio._resample(samples, rate, RATE)
    if stretch is not None:
        samples = stretch.push(samples)
    return audio.encode_audio(np.clip(samples, -1.0, 1.0), RATE, "pcm")


def low_detail(rgb: np.ndarray) -> str:
    """An image within 512 x 512 (aspect kept), as a PNG data URL."""
    from PIL import Image

    img = Image.fromarray(rgb)
    img.thumbnail((LOW_DETAIL, LOW_DETAIL), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
