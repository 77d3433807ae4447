"""Audio encode/decode for the HTTP front-end: round trips, resampling, and every rejection path."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile as sf
import torch

from omni_server.api import audio
from omni_server.api.audio import AudioError, content_type, decode_audio, decode_base64_audio, encode_audio

LIMITS = dict(max_bytes=10_000_000, max_seconds=30.0)
INT16_STEP = 1 / 32767


def sine(rate: int, seconds: float = 1.0, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def peak_hz(wave: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[np.argmax(spec)])


def lossy_formats():
    return [f for f in ("mp3", "opus") if f in audio.supported_output_formats()]


def test_supported_formats_always_include_the_basics():
    fmts = audio.SUPPORTED_OUTPUT_FORMATS
    assert isinstance(fmts, tuple)
    assert {"wav", "pcm", "pcm16", "flac"} <= set(fmts)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
@pytest.mark.parametrize("rate", [16000, 24000])
def test_lossless_round_trip(fmt, rate):
    x = sine(rate)
    data = encode_audio(torch.from_numpy(x), rate, fmt)
    y = decode_audio(data, target_rate=rate, **LIMITS)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.max(np.abs(y - x)) <= 2 * INT16_STEP


def test_wav_is_16_bit_pcm():
    info = sf.info(io.BytesIO(encode_audio(sine(24000), 24000, "wav")))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", "PCM_16", 24000, 1)


@pytest.mark.parametrize("name", ["pcm", "pcm16", "PCM"])
def test_pcm16_is_raw_little_endian_int16(name):
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0, np.nan], dtype=np.float32)
    data = encode_audio(x, 24000, name)
    assert len(data) == 2 * len(x)
    got = np.frombuffer(data, dtype="<i2")
    assert got.tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767, 0]  # clipped, NaN -> 0


def test_torch_tensor_input_on_any_dtype():
    x = sine(24000, 0.1)
    ref = encode_audio(x, 24000, "pcm")
    assert encode_audio(torch.from_numpy(x).unsqueeze(0), 24000, "pcm") == ref  # (1, N) is fine
    bf16 = encode_audio(torch.from_numpy(x).bfloat16(), 24000, "pcm")
    assert len(bf16) == len(ref)


@pytest.mark.parametrize("rate", [24000, 22050])  # 22050 is not an Opus rate: resampled on the way out
def test_lossy_round_trip(rate):
    if not lossy_formats():
        pytest.skip("no mp3/opus encoder in this libsndfile")
    x = sine(rate)
    for fmt in lossy_formats():
        y = decode_audio(encode_audio(x, rate, fmt), target_rate=16000, **LIMITS)
        assert abs(len(y) / 16000 - 1.0) < 0.1, fmt
        assert np.sqrt(np.mean(y**2)) > 0.2, fmt  # sine of amplitude 0.5 has RMS 0.35
        assert abs(peak_hz(y, 16000) - 440) < 5, fmt


@pytest.mark.parametrize("rate", [24000, 44100, 48000, 8000])
def test_resample_to_16k_keeps_length_and_pitch(rate):
    x = sine(rate, 1.0)
    y = decode_audio(encode_audio(x, rate, "wav"), target_rate=16000, **LIMITS)
    assert len(y) == 16000
    assert abs(peak_hz(y, 16000) - 440) < 2


def test_odd_input_rate_is_resampled_without_a_huge_filter():
    rate = 44101  # gcd(44101, 16000) == 1: exact polyphase would need a multi-GB kernel
    buf = io.BytesIO()
    sf.write(buf, sine(rate, 0.5), rate, format="WAV", subtype="PCM_16")
    y = decode_audio(buf.getvalue(), target_rate=16000, **LIMITS)
    assert abs(len(y) - 8000) <= 2
    assert abs(peak_hz(y, 16000) - 440) < 3


def test_stereo_is_downmixed():
    left, right = sine(16000, 0.5, 440, 0.4), sine(16000, 0.5, 440, 0.2)
    buf = io.BytesIO()
    sf.write(buf, np.stack([left, right], axis=1), 16000, format="FLAC", subtype="PCM_16")
    y = decode_audio(buf.getvalue(), target_rate=16000, **LIMITS)
    assert y.ndim == 1 and len(y) == 8000
    assert np.max(np.abs(y - (left + right) / 2)) < 1e-3


def test_content_types():
    assert content_type("wav") == "audio/wav"
    assert content_type("pcm") == content_type("pcm16") == "audio/pcm"
    assert content_type("flac") == "audio/flac"
    if "mp3" in audio.SUPPORTED_OUTPUT_FORMATS:
        assert content_type("mp3") == "audio/mpeg"
    if "opus" in audio.SUPPORTED_OUTPUT_FORMATS:
        assert content_type("opus") == "audio/ogg"


# --- rejections -------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [lambda: encode_audio(sine(16000, 0.1), 16000, "aac"),
                                  lambda: content_type("ogg-vorbis")])
def test_unsupported_output_format_lists_supported(call):
    with pytest.raises(AudioError) as e:
        call()
    assert "unsupported audio format" in str(e.value)
    for fmt in audio.SUPPORTED_OUTPUT_FORMATS:
        assert fmt in str(e.value)


def test_too_many_bytes():
    data = encode_audio(sine(16000, 1.0), 16000, "wav")
    with pytest.raises(AudioError, match=r"the limit is 1000 bytes"):
        decode_audio(data, max_bytes=1000, max_seconds=30)


def test_too_many_bytes_of_base64_is_refused_before_decoding():
    b64 = base64.b64encode(encode_audio(sine(16000, 1.0), 16000, "wav")).decode()
    with pytest.raises(AudioError, match=r"the limit is 1000 bytes"):
        decode_base64_audio(b64, max_bytes=1000, max_seconds=30)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_too_long(fmt):
    data = encode_audio(sine(16000, 3.0), 16000, fmt)
    with pytest.raises(AudioError, match=r"3\.0 s long; the limit is 2\.5 s"):
        decode_audio(data, max_bytes=10_000_000, max_seconds=2.5)


@pytest.mark.parametrize("data", [b"garbage" * 50, b"RIFF\x00\x00\x00\x00WAVE", bytes(range(256)) * 8,
                                  encode_audio(sine(16000), 16000, "flac")[:40]])
def test_undecodable_bytes(data):
    with pytest.raises(AudioError, match=r"could not decode audio") as e:
        decode_audio(data, **LIMITS)
    assert "BytesIO" not in str(e.value) and "Error opening" not in str(e.value)  # no libsndfile internals


@pytest.mark.parametrize("b64", ["not base64!!", "QUJD\nREVG", "QUJDRA", "QUJD-_==", "ÄÖÜ="])
def test_bad_base64(b64):
    with pytest.raises(AudioError, match=r"not valid base64"):
        decode_base64_audio(b64, **LIMITS)


def test_good_base64():
    x = sine(16000, 0.25)
    y = decode_base64_audio(base64.b64encode(encode_audio(x, 16000, "wav")).decode(), **LIMITS)
    assert len(y) == len(x)


def test_empty_bytes():
    with pytest.raises(AudioError, match=r"audio is empty"):
        decode_audio(b"", **LIMITS)
    with pytest.raises(AudioError, match=r"audio is empty"):
        decode_base64_audio("", **LIMITS)


def test_zero_length_audio():
    data = encode_audio(np.zeros(0, dtype=np.float32), 16000, "wav")
    with pytest.raises(AudioError, match=r"no samples"):
        decode_audio(data, **LIMITS)


@pytest.mark.parametrize("rate", [16000, 44100])
def test_audio_under_25_ms_is_refused(rate):
    """A 1-sample clip failed in the stage's feature extraction, its 400 the padding's internals."""
    with pytest.raises(AudioError, match=r"audio is 0\.\d ms long; the shortest taken is 25 ms"):
        decode_audio(encode_audio(np.zeros(1, dtype=np.float32), rate, "wav"), **LIMITS)
    n = int(np.ceil(0.025 * rate))
    assert len(decode_audio(encode_audio(np.zeros(n, dtype=np.float32), rate, "wav"), **LIMITS)) >= 400  # (16 kHz)


def test_unsupported_container():
    buf = io.BytesIO()
    sf.write(buf, sine(16000, 0.1), 16000, format="AIFF", subtype="PCM_16")
    with pytest.raises(AudioError, match=r"unsupported audio container AIFF"):
        decode_audio(buf.getvalue(), **LIMITS)


def test_unsupported_input_rate():
    buf = io.BytesIO()
    sf.write(buf, np.zeros(100, dtype=np.float32), 1000, format="WAV", subtype="PCM_16")
    with pytest.raises(AudioError, match=r"sample rate 1000 Hz; expected 4000-192000 Hz"):
        decode_audio(buf.getvalue(), **LIMITS)


# ---- StreamEncoder -----------------------------------------------------------------------------

def _streamed(fmt: str, wave: np.ndarray, rate: int, piece: int = 7000) -> tuple[list[bytes], bytes]:
    enc = audio.StreamEncoder(rate, fmt)
    out = [enc.push(wave[k:k + piece]) for k in range(0, len(wave), piece)]
    return out, enc.close()


@pytest.mark.parametrize("fmt", ["pcm", "pcm16", "wav"])
def test_stream_encoder_plain_formats_equal_whole_encoding(fmt):
    wave = sine(24000, 2.0)
    pieces, tail = _streamed(fmt, wave, 24000)
    assert all(pieces)  # every piece leaves at once
    whole = encode_audio(wave, 24000, fmt)
    data = b"".join(pieces) + tail
    if fmt == "wav":  # same samples; the streamed header says "size unknown"
        assert data[44:] == whole[44:] and data[:4] == b"RIFF" and data[40:44] == b"\xff\xff\xff\xff"
        decoded, rate = sf.read(io.BytesIO(data), dtype="int16")
        assert rate == 24000 and np.array_equal(decoded, np.frombuffer(whole[44:], "<i2"))
    else:
        assert data == whole


def test_stream_encoder_opus_streams_pages():
    if "opus" not in audio.supported_output_formats():
        pytest.skip("libsndfile without opus")
    wave = sine(24000, 3.0)
    pieces, tail = _streamed("opus", wave, 24000)
    assert sum(1 for p in pieces if p) >= 2  # Ogg pages leave before the end
    blocks = sf.blocks(io.BytesIO(b"".join(pieces) + tail), blocksize=4096, dtype="float32")
    decoded = np.concatenate(list(blocks))
    assert abs(len(decoded) - len(wave)) < 2000 and abs(peak_hz(decoded, 24000) - 440) < 5


def test_stream_encoder_opus_pages_leave_with_the_audio_pushed():
    """Each piece's audio leaves with it, up to a short page (libsndfile's default page held the
    first second of audio back)."""
    if "opus" not in audio.supported_output_formats():
        pytest.skip("libsndfile without opus")
    wave = sine(24000, 2.0)
    enc, sent = audio.StreamEncoder(24000, "opus"), b""
    for k in range(0, len(wave), 12000):  # pieces of 0.5 s
        sent += enc.push(wave[k:k + 12000])
        playable = len(sf.read(io.BytesIO(sent), dtype="float32")[0]) / 24000
        assert playable >= (k + 12000) / 24000 - 0.1, (k, playable)


@pytest.mark.parametrize("fmt", ["flac", "mp3"])
def test_stream_encoder_whole_file_formats_come_at_close(fmt):
    if fmt not in audio.supported_output_formats():
        pytest.skip(f"libsndfile without {fmt}")
    wave = sine(24000, 1.0)
    pieces, tail = _streamed(fmt, wave, 24000)
    assert not any(pieces) and tail == encode_audio(wave, 24000, fmt)


def test_a_truncated_mp3_decodes_to_the_audio_it_holds():
    """Its header promises the whole length: the frames the decoder really returned count, not the
    reused read buffer's (which repeated earlier audio or held garbage up to the promised length)."""
    if "mp3" not in audio.supported_output_formats():
        pytest.skip("libsndfile without mp3")
    data = encode_audio(sine(44100, 4.0), 44100, "mp3")
    wave = decode_audio(data[:len(data) // 2], **LIMITS)
    assert 1.5 < len(wave) / 16000 < 2.3


def test_a_wav_codec_libsndfile_cannot_seek_in_is_read_to_its_end():
    buf = io.BytesIO()
    sf.write(buf, sine(8000, 1.0), 8000, format="WAV", subtype="GSM610")
    wave = decode_audio(buf.getvalue(), max_bytes=10_000_000, max_seconds=120)  # (was "120.0 s long")
    # (GSM 06.10 codes whole frames of 160 samples at 8 kHz: the last is padded)
    assert 16000 <= len(wave) <= 16000 + 2 * 320 and abs(peak_hz(wave, 16000) - 440) < 5


def test_float_samples_past_full_scale_are_clipped():
    x = sine(16000, 0.5)
    x[::3] = 3e38
    x[1::3] = -2.0
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format="WAV", subtype="FLOAT")
    wave = decode_audio(buf.getvalue(), **LIMITS)
    assert np.isfinite(wave).all() and wave.max() == 1.0 and wave.min() == -1.0


def test_stream_encoder_opus_at_a_rate_opus_lacks_is_encoded_whole():
    """Opus takes 8/12/16/24/48 kHz: other audio is resampled, which piece by piece would click at
    every piece's edges and add samples, so it comes whole from close."""
    if "opus" not in audio.supported_output_formats():
        pytest.skip("libsndfile without opus")
    wave = sine(22050, 1.0)
    pieces, tail = _streamed("opus", wave, 22050, piece=1000)
    assert not any(pieces)
    # (each Ogg stream draws a random serial number: compare what they decode to)
    streamed, rate = sf.read(io.BytesIO(tail), dtype="float32")
    whole, _ = sf.read(io.BytesIO(encode_audio(wave, 22050, "opus")), dtype="float32")
    assert rate == 24000 and np.array_equal(streamed, whole)
