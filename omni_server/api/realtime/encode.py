"""The Realtime API's media as a session sends and keeps it: 24 kHz PCM16 audio (a reply's waveform
pieces converted, a user item's audio as WAV for the chat path; telephone formats, G.711 at 8 kHz,
converted to and from it as they stream) and images seen at `detail: low`."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np

from omni_server.api import audio, telephony
from omni_server.api.stretch import TimeStretch

RATE = 24000  # the Realtime API's PCM rate, in and out
FORMAT = {"type": "audio/pcm", "rate": RATE}
PCM = "audio/pcm"
FORMATS = {PCM: FORMAT, "audio/pcmu": {"type": "audio/pcmu"}, "audio/pcma": {"type": "audio/pcma"}}
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


def _int16(samples: np.ndarray) -> np.ndarray:
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")


def converter(fmt: str, up: bool) -> telephony.Converter | None:
    """The rate conversion a format needs (None: 24 kHz PCM16 needs none)."""
    return None if fmt == PCM else telephony.Converter(up=up)


def heard(raw: bytes, fmt: str, conv: telephony.Converter | None, last: bool = False) -> bytes:
    """Client audio in `fmt` as 24 kHz PCM16: a telephone format decoded and brought up to 24 kHz
    through `conv`, which carries a stream on from piece to piece (`last`: the stream ends here; a
    whole clip in a fresh converter comes out 3 samples for each 8 kHz one)."""
    if fmt == PCM:
        return raw
    y = conv.push(telephony.CODECS[fmt][0](raw).astype(np.float32) / 32768.0)
    return _int16(np.concatenate([y, conv.flush()]) if last else y).tobytes()


def said(pcm: bytes, fmt: str, conv: telephony.Converter | None, last: bool = False) -> bytes:
    """24 kHz PCM16 in the client's `fmt` (a telephone format: down to 8 kHz through `conv`, encoded;
    a whole clip, `last`, in a fresh converter: one 8 kHz sample each 3, rounded up)."""
    if fmt == PCM:
        return pcm
    y = conv.push(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0)
    return telephony.CODECS[fmt][1](_int16(np.concatenate([y, conv.flush()]) if last else y))
