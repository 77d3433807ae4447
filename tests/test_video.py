"""omni_server/api/video.py: frames kept at 2 a second by the stream's timestamps, and its limits."""

from __future__ import annotations

import pytest

from omni_server.api.video import VideoError, decode_video_url
from tests.media import mp4

BIG = 1 << 40


def _decode(url: str, **limits):
    return decode_video_url(url, **{"max_bytes": BIG, "max_pixels": BIG, "max_frames": 1 << 20,
                                    "max_total_pixels": BIG, **limits})


@pytest.mark.parametrize("frames, fps, kept", [(10, 4.0, 5), (3, 2.0, 3), (7, 1.0, 7), (1, 30.0, 1), (31, 30.0, 3)])
def test_frames_are_kept_at_two_a_second(frames, fps, kept):
    url, _ = mp4(frames, fps=fps, seed=frames)
    assert _decode(url).shape == (kept, 48, 64, 3)


def test_the_kept_frames_are_the_ones_at_each_half_second(tmp_path):
    """Against every frame OpenCV reads from the file: at 4 fps, frames 0, 2, 4 and 6."""
    import base64

    import cv2

    url, _ = mp4(8, fps=4.0)
    path = tmp_path / "v.mp4"
    path.write_bytes(base64.b64decode(url.split(",", 1)[1]))
    cap, every = cv2.VideoCapture(str(path)), []
    while (got := cap.read())[0]:
        every.append(cv2.cvtColor(got[1], cv2.COLOR_BGR2RGB))
    cap.release()
    kept = _decode(url)
    assert len(every) == 8 and len(kept) == 4
    assert all((k == every[2 * i]).all() for i, k in enumerate(kept))
    assert not (kept[1] == every[1]).all()  # (the frames differ: random pixels)


def test_limits():
    url, _ = mp4(10, fps=4.0)  # 5 frames kept, 64 x 48 each
    assert _decode(url, max_frames=5).shape[0] == 5
    with pytest.raises(VideoError, match="longer than the limit of 4 frames"):
        _decode(url, max_frames=4)
    with pytest.raises(VideoError, match="64x48 pixels; the limit is 3071"):
        _decode(url, max_pixels=64 * 48 - 1)
    assert _decode(url, max_total_pixels=5 * 64 * 48).shape[0] == 5
    with pytest.raises(VideoError, match="more than the limit of 15359 pixels in its 5 frames"):
        _decode(url, max_total_pixels=5 * 64 * 48 - 1)
    with pytest.raises(VideoError, match="larger than the limit of 100 bytes"):
        _decode(url, max_bytes=100)
    with pytest.raises(VideoError, match="must be a data:video"):  # (the api fetches http URLs first: api/fetch.py)
        _decode("https://example.com/a.mp4")
