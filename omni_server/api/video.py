"""Videos in chat requests (`data:video/...` URLs, or fetched bytes: api/fetch.py) decoded to RGB
frames sampled at a fixed rate, with size limits.

Frames are taken at `FPS` (2 a second, as Qwen's own video tools sample) by the stream's own
timestamps; the first stage tells its processor that rate, so the time positions the model sees
are the video's. The audio track is not read.
"""

from __future__ import annotations

import os
import re
import tempfile

import numpy as np

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


def decode_video(data: bytes, *, max_pixels: int, max_frames: int, max_total_pixels: int) -> np.ndarray:
    """`decode_video_url` of a video file's bytes."""
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
        due = 0.0  # the time of the next frame to keep, in seconds
        while True:
            ok, bgr = cap.read()
            if not ok:
                break
            if bgr.shape[0] * bgr.shape[1] > max_pixels:  # (a stream whose frames outgrow its header)
                raise VideoError(f"video frames exceed the limit of {max_pixels} pixels")
            t = cap.get(cv2.CAP_PROP_POS_MSEC) / 1000.0
            if t + 1e-6 < due:
                continue
            if len(frames) == max_frames:
                raise VideoError(f"video is longer than the limit of {max_frames} frames at {FPS:g} per "
                                 f"second ({max_frames / FPS:g} s)")
            if (len(frames) + 1) * bgr.shape[0] * bgr.shape[1] > max_total_pixels:
                raise VideoError(f"video has more than the limit of {max_total_pixels} pixels in its "
                                 f"{len(frames) + 1} frames at {FPS:g} per second")
            frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
            due += 1.0 / FPS
    finally:
        cap.release()
    if not frames:
        raise VideoError("video data could not be decoded (no frames)")
    return np.ascontiguousarray(np.stack(frames))
