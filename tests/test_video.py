"""omni_server/api/video.py: frames kept at 2 a second by the stream's timestamps, and its limits."""

from __future__ import annotations

import pytest

from omni_server.api.video import DECODED_PER_KEPT, VideoError, decode_video_url
from tests.media import mp4, mp4_with_gap

BIG = 1 << 40


def _decode(url: str, **limits):
    return decode_video_url(url, **{"max_bytes": BIG, "max_pixels": BIG, "max_frames": 1 << 20,
                                    "max_total_pixels": BIG, **limits})


# (1 fps: each frame shows twice, at its second and the half after: frame i is the video at i / 2 s)
@pytest.mark.parametrize("frames, fps, kept", [(10, 4.0, 5), (3, 2.0, 3), (7, 1.0, 13), (1, 30.0, 1), (31, 30.0, 3)])
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


def test_a_gap_in_the_timestamps_shows_the_frame_before_it():
    """Frame i is the picture at i / 2 s: over 3.25 s without frames (0.75 -> 4.0) the one at 0.5 s
    stands, so the frames after the gap keep their times (they were each kept, as if at 1.0, 1.5, ...)."""
    url = mp4_with_gap(4, 3.0, 4)  # frames at 0, .25, .5, .75, then 4.0, 4.25, 4.5, 4.75
    every, _ = mp4(8, fps=4.0)  # (the same frames without the gap)
    plain = _decode(every)
    kept = _decode(url)
    assert kept.shape[0] == 10  # 0, 0.5, then 1.0 ... 3.5 repeating 0.5, then 4.0 and 4.5
    assert (kept[0] == plain[0]).all() and all((kept[i] == plain[1]).all() for i in range(1, 8))
    assert (kept[8] == plain[2]).all() and (kept[9] == plain[3]).all()


def test_only_the_containers_it_names_are_opened():
    """FFmpeg picks its reader by content: a playlist (ffconcat names local files to play) or an
    image sent as video must not reach it."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(png, format="PNG")
    for body in (b"ffconcat version 1.0\nfile clip.mp4\n", b"#EXTM3U\n#EXT-X-VERSION:3\n", png.getvalue()):
        with pytest.raises(VideoError, match="not MP4 / QuickTime, Matroska / WebM, AVI or MPEG"):
            _decode("data:video/mp4;base64," + base64.b64encode(body).decode())


def test_the_frames_decoded_are_bounded_too():
    """Frames skipped are decoded as well: at most DECODED_PER_KEPT x max_total_pixels of them (a
    long high-rate video within the kept-frame limits is CPU-hours otherwise)."""
    url, _ = mp4(40, fps=120.0)  # 40 frames of 64 x 48 decoded, 1 kept
    frame = 64 * 48
    assert _decode(url, max_total_pixels=2 * frame).shape[0] == 1
    budget = -(-40 * frame // DECODED_PER_KEPT) - 1  # (decoding 40 frames needs more than 30 x this)
    with pytest.raises(VideoError, match="more frames to decode than the limit"):
        _decode(url, max_total_pixels=budget)
    # However small the frames: at most DECODED_PER_KEPT x max_frames decoded (40 > 30 x 1).
    with pytest.raises(VideoError, match="more frames to decode than the limit: 30 x 1 "):
        _decode(url, max_frames=1)
    assert _decode(url, max_frames=2).shape[0] == 1
