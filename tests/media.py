"""Synthetic media for chat tests: what the client sends and what both sides decode from it."""

from __future__ import annotations

import base64
import io

import numpy as np
import soundfile as sf


def tone_wav(seconds: float = 1.5, rate: int = 16000) -> tuple[str, np.ndarray]:
    """A two-tone 16-bit wav (base64) and the float samples both sides decode from it."""
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * np.sin(2 * np.pi * 1250 * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format="WAV", subtype="PCM_16")
    data = buf.getvalue()
    heard, _ = sf.read(io.BytesIO(data), dtype="float32")
    return base64.b64encode(data).decode(), heard


def png(width: int, height: int, seed: int | None = 0) -> tuple[str, np.ndarray]:
    """A PNG data URL and its pixels: random, or one flat color (compresses to almost nothing) for seed None."""
    from PIL import Image

    if seed is None:
        rgb = np.full((height, width, 3), 200, dtype=np.uint8)
    else:
        rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), rgb


def mp4(frames: int, fps: float = 4.0, width: int = 64, height: int = 48, seed: int = 0) -> tuple[str, np.ndarray]:
    """An MP4 data URL of random frames, and the frames the server keeps of it (2 a second, as
    decoded: the codec is lossy)."""
    import tempfile

    import cv2

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/v.mp4"
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        for _ in range(frames):
            writer.write(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        writer.release()
        with open(path, "rb") as f:
            url = "data:video/mp4;base64," + base64.b64encode(f.read()).decode()
    return url, kept_frames(url)


def kept_frames(url: str) -> np.ndarray:
    """The frames the server keeps of a video data URL."""
    from omni_server.api.video import decode_video_url

    return decode_video_url(url, max_bytes=1 << 30, max_pixels=1 << 30, max_frames=1 << 20, max_total_pixels=1 << 40)


def mp4_with_gap(before: int, gap_s: float, after: int, fps: float = 4.0, seed: int = 0) -> str:
    """An MP4 data URL of `before` frames at `fps`, then `after` more starting `gap_s` seconds after
    the last one would have ended: its sample table's durations rewritten (the frames' times are
    in `stts`, in a `moov` that OpenCV's writer puts after the media data, so no offset moves) and
    its edit list dropped."""
    import struct

    url, _ = mp4(before + after, fps=fps, seed=seed)
    data = bytearray(base64.b64decode(url.split(",", 1)[1]))
    path, off, end = [], 0, len(data)  # (offset of each box on the way to stts)
    while True:
        size, kind = struct.unpack(">I4s", data[off:off + 8])
        if kind == b"stts":
            break
        if kind == b"edts":  # (its edit list would end the track at the old duration: made padding)
            data[off + 4:off + 8] = b"free"
        if kind in (b"moov", b"trak", b"mdia", b"minf", b"stbl"):
            path.append(off)
            off, end = off + 8, off + size
        else:
            off += size
        assert off < end, "no stts box"
    (count, delta) = struct.unpack(">II", data[off + 16:off + 24])
    assert count == before + after
    entries = [(before - 1, delta), (1, delta + round(gap_s * fps * delta)), (after, delta)]
    table = struct.pack(">II", 0, len(entries)) + b"".join(struct.pack(">II", n, d) for n, d in entries)
    grow = 8 + len(table) - size
    data[off:off + size] = struct.pack(">I4s", 8 + len(table), b"stts") + table
    for parent in path:
        data[parent:parent + 4] = struct.pack(">I", struct.unpack(">I", data[parent:parent + 4])[0] + grow)
    return "data:video/mp4;base64," + base64.b64encode(bytes(data)).decode()


def video_with_audio(frames: int = 6, fps: float = 4.0, audio_s: float = 1.5, rate: int = 44100, channels: int = 2,
                     container: str = "mp4", width: int = 64, height: int = 48, tone_hz: float = 440.0,
                     seed: int = 0) -> tuple[str, np.ndarray]:
    """A video data URL with an audio track (mp4: MPEG-4 video + AAC; webm: VP8 + Opus; mkv:
    MPEG-4 + FLAC) of a sine at `tone_hz` on every channel, and the sine at 16 kHz as sent."""
    import fractions

    import av

    codecs = {"mp4": ("mpeg4", "aac", "fltp"), "webm": ("libvpx", "libopus", "s16"), "mkv": ("mpeg4", "flac", "s16")}
    vcodec, acodec, sample_fmt = codecs[container]
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format={"mkv": "matroska"}.get(container, container)) as out:
        vs = out.add_stream(vcodec, rate=fractions.Fraction(fps).limit_denominator(1000))
        vs.width, vs.height, vs.pix_fmt = width, height, "yuv420p"
        layout = "mono" if channels == 1 else "stereo"
        aus = out.add_stream(acodec, rate=rate, layout=layout)
        for _ in range(frames):
            picture = av.VideoFrame.from_ndarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), format="rgb24")
            out.mux(vs.encode(picture))
        out.mux(vs.encode(None))
        t = np.arange(int(audio_s * rate)) / rate
        sine = (0.5 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)
        step = 960
        for at in range(0, sine.size, step):
            block = np.repeat(sine[None, at:at + step], channels, axis=0)
            if sample_fmt == "s16":
                block = (block * 32767).astype(np.int16).T.reshape(1, -1)  # (packed: interleaved channels)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(block), format=sample_fmt, layout=layout)
            frame.sample_rate, frame.pts = rate, at
            out.mux(aus.encode(frame))
        out.mux(aus.encode(None))
    mime = {"mp4": "mp4", "webm": "webm", "mkv": "x-matroska"}[container]
    t16 = np.arange(int(audio_s * 16000)) / 16000
    return (f"data:video/{mime};base64," + base64.b64encode(buf.getvalue()).decode(),
            (0.5 * np.sin(2 * np.pi * tone_hz * t16)).astype(np.float32))
