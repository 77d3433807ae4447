"""Audio in and out of the HTTP front-end: encode model output for responses, decode client uploads.

Both directions go through libsndfile (bundled in the `soundfile` wheel). Decoding is CPU-bound and
blocking: call it from a worker thread, not the event loop.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import logging
import math
import re
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import soundfile as sf

from omni_server.api.data_url import payload
from omni_server.api.stretch import TimeStretch

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

_CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "pcm16": "audio/pcm", "flac": "audio/flac",
                  "mp3": "audio/mpeg", "opus": "audio/ogg"}
# fmt -> (libsndfile container, subtype) for the formats written through libsndfile.
_SF_FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
               "opus": ("OGG", "OPUS")}
# The codecs only accept these rates; anything else is resampled up to the next one.
_CODEC_RATES = {"mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
                "opus": (8000, 12000, 16000, 24000, 48000)}
# Containers accepted on input. libsndfile opens many more; keep the parser surface to what we promise.
_INPUT_CONTAINERS = {"WAV", "WAVEX", "RF64", "FLAC", "MP3", "OGG"}
# Bounds memory (rate x max_seconds) and the resampler's filter size.
_MIN_INPUT_RATE, _MAX_INPUT_RATE = 4000, 192000
# Shortest audio taken: speech encoders frame it in 25 ms windows (Whisper's features pad 200 samples
# each side by reflection, which needs more than that many; a 1-sample clip failed in the stage).
MIN_AUDIO_SECONDS = 0.025
_MAX_RESAMPLE_FACTOR = 1000  # largest up/down factor handed to the polyphase resampler


class AudioError(ValueError):
    """Bad audio or an unsupported format. The message is safe to show to API clients."""


def _canonical(fmt: str) -> str:
    fmt = fmt.strip().lower()
    return "pcm" if fmt == "pcm16" else fmt


@functools.cache
def supported_output_formats() -> tuple[str, ...]:
    """Formats `encode_audio` can write here; mp3/opus depend on how libsndfile was built."""
    out = ["wav", "pcm", "pcm16"]
    for fmt in ("flac", "mp3", "opus"):
        container, subtype = _SF_FORMATS[fmt]
        try:
            buf = io.BytesIO()
            sf.write(buf, np.zeros(480, dtype=np.float32), 24000, format=container, subtype=subtype)
            if buf.getvalue():
                out.append(fmt)
        except Exception:  # noqa: BLE001 - any failure means "not available"
            pass
    return tuple(out)


def __getattr__(name: str) -> Any:
    # SUPPORTED_OUTPUT_FORMATS is probed on first access, not at import.
    if name == "SUPPORTED_OUTPUT_FORMATS":
        return supported_output_formats()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_format(fmt: str) -> str:
    canon = _canonical(fmt)
    if canon not in supported_output_formats():
        raise AudioError(f"unsupported audio format {fmt!r}; supported: {', '.join(supported_output_formats())}")
    return canon


def content_type(fmt: str) -> str:
    return _CONTENT_TYPES[_check_format(fmt)]


def _to_numpy(wave: torch.Tensor | np.ndarray) -> np.ndarray:
    if not isinstance(wave, np.ndarray):  # torch tensor (any device / dtype, incl. bf16)
        wave = wave.detach().to("cpu").float().numpy()
    wave = np.asarray(wave, dtype=np.float32)
    if sum(n > 1 for n in wave.shape) > 1:
        raise AudioError(f"expected a 1-D waveform, got shape {wave.shape}")
    wave = wave.reshape(-1)  # ([1, n], [n, 1], one sample: all 1-D; squeeze made one sample 0-D)
    # NaN would become an arbitrary int16; a diverging vocoder should not produce that.
    return np.clip(np.nan_to_num(wave, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)


def _to_int16(wave: np.ndarray) -> np.ndarray:
    return np.round(wave * 32767.0).astype("<i2")


def encode_audio(wave: torch.Tensor | np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode a mono float waveform in [-1, 1] as `fmt` (see `supported_output_formats()`)."""
    fmt = _check_format(fmt)
    wave = _to_numpy(wave)
    if fmt == "pcm":
        return _to_int16(wave).tobytes()
    if fmt in _CODEC_RATES:
        if wave.size == 0:
            return b""  # libsndfile writes nothing (mp3) or a malformed stream (opus) for no samples
        rates = _CODEC_RATES[fmt]
        if sample_rate not in rates:
            target = next((r for r in rates if r >= sample_rate), rates[-1])
            wave, sample_rate = _resample(wave, sample_rate, target), target
        data = np.ascontiguousarray(wave)
    else:
        data = _to_int16(wave)  # write exactly what pcm16 would carry
    container, subtype = _SF_FORMATS[fmt]
    buf = io.BytesIO()
    sf.write(buf, data, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


# Formats whose bytes can leave as the audio is made. libsndfile finishes FLAC and MP3 files by
# rewriting their first bytes (FLAC's sample count, MP3's LAME tag frame), which a stream has
# already sent: those are encoded whole when the audio is complete.
STREAMABLE_FORMATS = ("pcm", "pcm16", "wav", "opus")


class StreamEncoder:
    """Encodes a waveform that arrives in pieces: `push` returns the bytes ready so far, `close`
    the rest; all of them concatenated are one playable file. wav gets a header with unknown
    (0xFFFFFFFF) sizes, as streamed WAV does; pcm is headerless; formats not in
    STREAMABLE_FORMATS come out whole from `close`. `speed` (0.25-4): played that much faster at
    the same pitch (stretch.py), as the pieces come."""

    def __init__(self, sample_rate: int, fmt: str, speed: float = 1.0):
        self.fmt = _check_format(fmt)
        self._stretch = TimeStretch(sample_rate, speed) if speed != 1.0 else None
        self.rate = sample_rate
        self._header = self.fmt == "wav"
        self._file: sf.SoundFile | None = None
        self._pieces: list[np.ndarray] | None = None  # formats encoded whole
        self._buf = io.BytesIO()
        self._sent = 0
        if self.fmt == "opus" and sample_rate in _CODEC_RATES["opus"]:
            container, subtype = _SF_FORMATS["opus"]
            self._file = sf.SoundFile(self._buf, "w", samplerate=self.rate, channels=1, format=container,
                                      subtype=subtype)
            _short_ogg_pages(self._file)
        elif self.fmt not in ("pcm", "wav"):
            # (Also Opus at a rate it does not take: resampling piece by piece would click at every
            # piece's edges, so that audio is resampled and encoded whole.)
            self._pieces = []

    def push(self, wave: torch.Tensor | np.ndarray) -> bytes:
        wave = _to_numpy(wave)
        if self._stretch is not None:
            wave = self._stretch.push(wave)
        return self._encode(wave)

    def _encode(self, wave: np.ndarray) -> bytes:
        if self._pieces is not None:
            self._pieces.append(wave)
            return b""
        if self._file is not None:
            if wave.size:
                self._file.write(np.ascontiguousarray(wave))
            data = self._buf.getbuffer()[self._sent:].tobytes()
            self._sent += len(data)
            return data
        data = _to_int16(wave).tobytes()
        if self._header:
            self._header = False
            data = _streaming_wav_header(self.rate) + data
        return data

    def close(self) -> bytes:
        head = b""
        if self._stretch is not None:
            head, self._stretch = self._encode(self._stretch.flush()), None
        return head + self._close()

    def _close(self) -> bytes:
        if self._pieces is not None:
            whole = np.concatenate(self._pieces) if self._pieces else np.zeros(0, dtype=np.float32)
            return encode_audio(whole, self.rate, self.fmt)
        if self._file is not None:
            self._file.close()  # flushes the codec's buffered frames
            return self._buf.getbuffer()[self._sent:].tobytes()
        return self._encode(np.zeros(0, dtype=np.float32)) if self._header else b""


# libsndfile's SFC_SET_OGG_PAGE_LATENCY_MS (sndfile.h): how much audio an Ogg Opus page holds
# before it is written. Its default, 1000 ms, kept a stream's first audio back for a second.
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302
OPUS_PAGE_MS = 20.0  # (libsndfile raises it to its minimum, ~50 ms: pages then cost ~8% more bytes)


def _short_ogg_pages(f: sf.SoundFile) -> None:
    """Ask libsndfile for short Ogg pages (sf_command through soundfile's own C handle); a build
    without the command keeps its default pages."""
    try:
        from soundfile import _ffi, _snd

        _snd.sf_command(f._file, _SFC_SET_OGG_PAGE_LATENCY_MS, _ffi.new("double *", OPUS_PAGE_MS),
                        _ffi.sizeof("double"))
    except (ImportError, AttributeError):
        log.debug("soundfile without sf_command: Ogg pages of libsndfile's default length")


def _streaming_wav_header(rate: int) -> bytes:
    unknown = 0xFFFFFFFF
    return (b"RIFF" + unknown.to_bytes(4, "little") + b"WAVE" + b"fmt " + (16).to_bytes(4, "little")
            + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + rate.to_bytes(4, "little")
            + (rate * 2).to_bytes(4, "little") + (2).to_bytes(2, "little") + (16).to_bytes(2, "little")
            + b"data" + unknown.to_bytes(4, "little"))


def _resample(wave: np.ndarray, orig: int, new: int) -> np.ndarray:
    if orig == new or wave.size == 0:
        return wave
    import torch
    import torchaudio.functional as AF

    # The polyphase filter bank is (new/g) x (orig/g) taps, so a rate like 44101 Hz would build a
    # multi-GB kernel. Cap both factors (the rate error this introduces: ~250 ppm at 4001 Hz, less above).
    ratio = Fraction(new, orig)
    if max(ratio.numerator, ratio.denominator) > _MAX_RESAMPLE_FACTOR:
        ratio = ratio.limit_denominator(max(1, int(_MAX_RESAMPLE_FACTOR / max(1.0, float(ratio)))))
    out = AF.resample(torch.from_numpy(np.ascontiguousarray(wave)), ratio.denominator, ratio.numerator)
    return out.numpy().astype(np.float32, copy=False)


def _size_error(n: int, max_bytes: int, approx: bool = False) -> AudioError:
    return AudioError(f"audio is {'about ' if approx else ''}{n} bytes; the limit is {max_bytes} bytes")


def _duration_error(seconds: float, max_seconds: float) -> AudioError:
    return AudioError(f"audio is {seconds:.1f} s long; the limit is {max_seconds:g} s")


def decode_audio(data: bytes, *, target_rate: int = 16000, max_bytes: int, max_seconds: float) -> np.ndarray:
    """Decode WAV / MP3 / FLAC / Ogg bytes to mono float32 at `target_rate`."""
    if len(data) > max_bytes:
        raise _size_error(len(data), max_bytes)
    if not data:
        raise AudioError("audio is empty")
    try:
        f = sf.SoundFile(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - libsndfile's messages name internals; say what we accept
        raise AudioError("could not decode audio; expected WAV, MP3, FLAC or Ogg (Vorbis/Opus) data") from None
    with f:
        if f.format not in _INPUT_CONTAINERS:
            raise AudioError(f"unsupported audio container {f.format}; expected WAV, MP3, FLAC or Ogg")
        rate = f.samplerate
        check_rate(rate)
        max_frames = math.floor(max_seconds * rate)
        # Header length first, so an over-long upload is refused without decoding it.
        if f.frames > max_frames:
            raise _duration_error(f.frames / rate, max_seconds)
        # Downmix block by block so many-channel input never sits in memory whole; stop one past the
        # limit in case the header understated the length. (`read`, not `blocks`: blocks yields its
        # whole buffer even when the decoder returned fewer frames, e.g. a truncated MP3, whose
        # header promises more, or a WAV codec libsndfile cannot seek in.)
        blocks, n = [], 0
        try:
            while n <= max_frames:
                block = f.read(min(1 << 16, max_frames + 1 - n), dtype="float32", always_2d=True)
                if not len(block):
                    break
                blocks.append(block.mean(axis=1))
                n += len(block)
        except Exception:  # noqa: BLE001
            raise AudioError("could not decode audio; the data is corrupt") from None
    wave = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)
    return finish_decoded(wave, rate, target_rate=target_rate, max_seconds=max_seconds)


def check_rate(rate: int) -> None:
    if not _MIN_INPUT_RATE <= rate <= _MAX_INPUT_RATE:
        raise AudioError(f"unsupported sample rate {rate} Hz; expected {_MIN_INPUT_RATE}-{_MAX_INPUT_RATE} Hz")


def finish_decoded(wave: np.ndarray, rate: int, *, target_rate: int, max_seconds: float) -> np.ndarray:
    """A decoded mono wave at `rate`, checked (length, finite samples) and resampled to `target_rate`."""
    if wave.size > math.floor(max_seconds * rate):
        raise _duration_error(wave.size / rate, max_seconds)
    if wave.size == 0:
        raise AudioError("audio contains no samples")
    # Float WAV may carry NaN, inf or values far past full scale (3e38 made the feature extractor's
    # spectrum NaN): clipped to full scale, as a player would.
    wave = np.clip(np.nan_to_num(wave, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)
    if wave.size < MIN_AUDIO_SECONDS * rate:
        raise AudioError(f"audio is {wave.size / rate * 1000:.1f} ms long; the shortest taken is "
                         f"{MIN_AUDIO_SECONDS * 1000:g} ms")
    return np.ascontiguousarray(_resample(wave, rate, target_rate), dtype=np.float32)


_DATA_URL = re.compile(r"^data:audio/(wav|x-wav|wave|mpeg|mp3|flac|x-flac|ogg|opus);base64,", re.IGNORECASE)


def audio_data_url(url: str, *, max_bytes: int) -> bytes:
    """The file bytes of a base64 `data:audio/...` URL (an `audio_url` part)."""
    return payload(url, _DATA_URL, kind="audio", accepted="data:audio/(wav|mpeg|flac|ogg);base64,...",
                   max_bytes=max_bytes, error=AudioError)


def decode_base64_audio(b64: str | bytes, *, target_rate: int = 16000, max_bytes: int,
                        max_seconds: float) -> np.ndarray:
    """`decode_audio` for base64 text (strict: no whitespace, no URL-safe alphabet, correct padding)."""
    # Refuse oversized payloads before allocating their decoded copy.
    if len(b64) > 4 * -(-max_bytes // 3):
        raise _size_error(len(b64) * 3 // 4, max_bytes, approx=True)
    try:
        data = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise AudioError("audio is not valid base64") from None
    return decode_audio(data, target_rate=target_rate, max_bytes=max_bytes, max_seconds=max_seconds)
