"""Videos in chat requests (`data:video/...` URLs, or fetched bytes: api/fetch.py) decoded to RGB
frames sampled at a fixed rate, with size limits.

Frames are taken at `FPS` (2 a second, as Qwen's own video tools sample) by the stream's own
timestamps; the first stage tells its processor that rate, so the time positions the model sees
are the video's. A video's audio track is read where the request asks the model to hear it
(`decode_video_audio`, with PyAV).
"""

from __future__ import annotations

import io
import math
import os
import re
import tempfile

import numpy as np

from omni_server.api import audio
from omni_server.api.data_url import payload
from omni_server.wire.messages import VIDEO_FPS as FPS

_DATA_URL = re.compile(r"^data:video/(mp4|webm|quicktime|x-matroska|x-msvideo|mpeg);base64,", re.IGNORECASE)


class VideoError(ValueError):
    """A video the server will not take; the message is safe to show to the client."""


def decode_video_url(url: str, *, max_bytes: int, max_pixels: int, max_frames: int,
                     max_total_pixels: int) -> np.ndarray:
    """RGB uint8 [frames, height, width, 3] of a base64 `data:video/...` URL, `FPS` frames per
    second of video (at least one). `max_pixels` bounds a frame, `max_total_pixels` the frames kept
    (what the api holds in memory: 3 bytes a pixel)."""
    return decode_video(video_data_url(url, max_bytes=max_bytes), max_pixels=max_pixels, max_frames=max_frames,
                        max_total_pixels=max_total_pixels)


def video_data_url(url: str, *, max_bytes: int) -> bytes:
    """The file bytes of a base64 `data:video/...` URL."""
    return payload(url, _DATA_URL, kind="video",
                   accepted="data:video/(mp4|webm|quicktime|x-matroska|x-msvideo|mpeg);base64,...",
                   max_bytes=max_bytes, error=VideoError)


# Frames decoded (kept or not) per frame kept, at most: a 60 fps video sampled at 2 a second. Bounds
# the decoding work a request can ask for: frames of `DECODED_PER_KEPT` x max_total_pixels in all,
# and `DECODED_PER_KEPT` x max_frames frames (each costs its decode whatever its size: 300k frames of
# 16x16 in 4 MB took ~7 s of a media thread within the pixel bound).
DECODED_PER_KEPT = 30


def _demuxer(head: bytes) -> str | None:
    """FFmpeg's demuxer for a file starting with these bytes, among the containers the data: URLs
    name; None: another. (FFmpeg would pick one by content, and some of its formats are playlists
    that read other files: ffconcat names local ones.)"""
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):  # (MP4 / QuickTime: a box type)
        return "mov"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # (EBML: Matroska, WebM)
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:4] in (b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3"):  # (MPEG program / elementary stream)
        return "mpeg"
    if len(head) > 376 and head[0] == head[188] == head[376] == 0x47:  # (MPEG transport stream)
        return "mpegts"
    return None


_NOT_NAMED = "video data could not be decoded: it is not MP4 / QuickTime, Matroska / WebM, AVI or MPEG"


def decode_video(data: bytes, *, max_pixels: int, max_frames: int, max_total_pixels: int) -> np.ndarray:
    """`decode_video_url` of a video file's bytes."""
    if _demuxer(data[:400]) is None:
        raise VideoError(_NOT_NAMED)
    # OpenCV's FFmpeg reader opens files only: the bytes go to a private temporary file.
    fd, path = tempfile.mkstemp(suffix=".video")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return _frames(path, max_pixels=max_pixels, max_frames=max_frames, max_total_pixels=max_total_pixels)
    finally:
        os.unlink(path)


def _frames(path: str, *, max_pixels: int, max_frames: int, max_total_pixels: int) -> np.ndarray:
    import cv2

    cap = cv2.VideoCapture(path)
    try:
        if not cap.isOpened():
            raise VideoError("video data could not be decoded")
        width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if width * height > max_pixels:
            raise VideoError(f"video is {width}x{height} pixels; the limit is {max_pixels} pixels")
        frames: list[np.ndarray] = []
        decodable, frames_left = DECODED_PER_KEPT * max_total_pixels, DECODED_PER_KEPT * max_frames
        step, due = 1.0 / FPS, None  # due: the time of the next frame to keep, in seconds
        while cap.grab():  # (decodes; only frames kept are converted)
            decodable -= max(width * height, 1)
            frames_left -= 1
            if frames_left < 0:
                raise VideoError(f"video has more frames to decode than the limit: {DECODED_PER_KEPT} x "
                                 f"{max_frames} (over {DECODED_PER_KEPT * FPS:g} frames a second at the frame limit)")
            if decodable < 0:
                raise VideoError(f"video has more frames to decode than the limit: {DECODED_PER_KEPT} x "
                                 f"{max_total_pixels} pixels in all (over {DECODED_PER_KEPT * FPS:g} frames a second "
                                 "at the frame and pixel limits)")
            t = cap.get(cv2.CAP_PROP_POS_MSEC) / 1000.0
            due = t if due is None else due  # (times count from the first frame's)
            if t + 1e-6 < due:
                continue
            ok, bgr = cap.retrieve()
            if not ok:
                break
            if bgr.shape[0] * bgr.shape[1] > max_pixels:  # (a stream whose frames outgrow its header)
                raise VideoError(f"video frames exceed the limit of {max_pixels} pixels")
            # Frame i is the picture at i / FPS: times a gap in the stream skipped show the frame before it.
            while frames and t + 1e-6 >= due + step:
                _keep(frames, frames[-1], max_frames, max_total_pixels)
                due += step
            _keep(frames, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), max_frames, max_total_pixels)
            due += step
    finally:
        cap.release()
    if not frames:
        raise VideoError("video data could not be decoded (no frames)")
    return np.ascontiguousarray(np.stack(frames))


def _keep(frames: list[np.ndarray], rgb: np.ndarray, max_frames: int, max_total_pixels: int) -> None:
    if len(frames) == max_frames:
        raise VideoError(f"video is longer than the limit of {max_frames} frames at {FPS:g} per "
                         f"second ({max_frames / FPS:g} s)")
    if (len(frames) + 1) * rgb.shape[0] * rgb.shape[1] > max_total_pixels:
        raise VideoError(f"video has more than the limit of {max_total_pixels} pixels in its "
                         f"{len(frames) + 1} frames at {FPS:g} per second")
    frames.append(rgb)


# Audio frames decoded per second of the limit, at most (AAC's are ~21 ms, Opus's 2.5-60 ms): bounds
# the work of a track cut into tiny frames, as DECODED_PER_KEPT does for pictures.
_AUDIO_FRAMES_PER_S = 1000
# The audio codecs read (FFmpeg has ~200 decoders, many rarely used or audited: these are what
# cameras, phones and encoders write), and the most channels (each one's samples cost decoding).
_TRACK_CODECS = {"aac", "aac_fixed", "mp3", "mp3float", "mp2", "mp2float", "opus", "libopus", "vorbis",
                 "libvorbis", "flac", "alac", "ac3", "eac3"}
_MAX_TRACK_CHANNELS = 8
# Decoded audio past the track's stated length that is cut (an encoder's padding of its last frame);
# more is kept: a container's stated length may be an estimate.
_PADDING_S = 0.1


def decode_video_audio(data: bytes, *, target_rate: int, max_seconds: float) -> np.ndarray:
    """Mono float32 at `target_rate` of a video file's first audio track, whole (the model hears
    it beside the frames from the start, as Qwen's own video tools read it)."""
    fmt = _demuxer(data[:400])
    if fmt is None:
        raise VideoError(_NOT_NAMED)
    try:
        import av
    except ImportError:
        raise VideoError("this server cannot read a video's audio track (PyAV is not installed)") from None
    try:
        with av.open(io.BytesIO(data), format=fmt) as box:
            if not box.streams.audio:
                raise VideoError("video has no audio track")
            stream = box.streams.audio[0]
            codec, rate = stream.codec_context.name, stream.codec_context.sample_rate
            if codec not in _TRACK_CODECS and not codec.startswith("pcm_"):
                raise VideoError(f"its audio track's codec {codec} is not read here; AAC, MP3, Opus, Vorbis, "
                                 "FLAC, ALAC, AC-3 and PCM are")
            if stream.codec_context.channels > _MAX_TRACK_CHANNELS:
                raise VideoError(f"its audio track has {stream.codec_context.channels} channels; the limit is "
                                 f"{_MAX_TRACK_CHANNELS}")
            try:
                audio.check_rate(rate)
            except audio.AudioError as e:
                raise VideoError(f"its audio track: {e}") from None
            # Planar float at the track's first rate, one converter per frame shape seen: a converter
            # handed frames it was not made for passes them through as they are.
            converters: dict[tuple, av.AudioResampler] = {}
            blocks, samples, frames_left = [], 0, math.ceil(max_seconds * _AUDIO_FRAMES_PER_S)
            for frame in box.decode(stream):
                frames_left -= 1
                if frames_left < 0:
                    raise VideoError(f"its audio track has more frames to decode than the limit "
                                     f"({_AUDIO_FRAMES_PER_S} a second of server.max_audio_seconds)")
                if len(frame.layout.channels) > _MAX_TRACK_CHANNELS:
                    raise VideoError(f"its audio track has more than {_MAX_TRACK_CHANNELS} channels")
                shape = (frame.format.name, frame.layout.name, frame.sample_rate)
                if shape not in converters:
                    converters[shape] = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=rate)
                for out in converters[shape].resample(frame):
                    blocks.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
                    samples += blocks[-1].size
                if samples > max_seconds * rate:
                    raise VideoError(f"its audio track is longer than the limit of {max_seconds:g} s "
                                     "(server.max_audio_seconds)")
            for converter in converters.values():
                for out in converter.resample(None):
                    blocks.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
            # The track's stated length, when it states one: an encoder's padding at the end (AAC's
            # last frame) is not the sender's audio (a 30.0 s track read as 30.0002 s).
            stated = (round(float(stream.duration * stream.time_base) * rate)
                      if stream.duration and stream.time_base else None)
    except VideoError:
        raise
    except Exception:  # noqa: BLE001 - FFmpeg's and PyAV's errors on a bad file name internals
        raise VideoError("the video's audio track could not be decoded") from None
    wave = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)
    if stated and stated < wave.size <= stated + _PADDING_S * rate:
        wave = wave[:stated]
    try:
        return audio.finish_decoded(wave, rate, target_rate=target_rate, max_seconds=max_seconds)
    except audio.AudioError as e:
        raise VideoError(f"its audio track: {e}") from None
