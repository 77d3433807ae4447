"""omni_server/api/image.py: images decoded upright to RGB, only the formats it names, within limits."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from omni_server.api.image import ImageError, decode_image

BIG = 1 << 30


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_a_photo_stored_sideways_comes_upright():
    """EXIF orientation 6 (rotate 90 degrees clockwise to view): 40 x 20 stored, 20 x 40 seen."""
    stored = np.zeros((20, 40, 3), dtype=np.uint8)
    stored[:, :20] = 255  # the stored left half white: the viewed top half
    exif = Image.Exif()
    exif[0x0112] = 6
    rgb = decode_image(_encode(Image.fromarray(stored), "JPEG", exif=exif, quality=95), max_pixels=BIG)
    assert rgb.shape == (40, 20, 3)
    assert rgb[:18].mean() > 240 and rgb[22:].mean() < 15


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_the_named_formats_decode(fmt):
    pixels = np.random.default_rng(0).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    rgb = decode_image(_encode(Image.fromarray(pixels), fmt), max_pixels=BIG)
    assert rgb.shape == (12, 16, 3) and rgb.dtype == np.uint8
    if fmt in ("PNG", "BMP"):  # (lossless)
        assert (rgb == pixels).all()


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM"])
def test_other_formats_pillow_reads_are_refused(fmt):
    data = _encode(Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)), fmt)
    with pytest.raises(ImageError, match="could not be decoded"):
        decode_image(data, max_pixels=BIG)


def test_the_pixel_limit_is_checked_before_decoding():
    data = _encode(Image.new("RGB", (64, 48)), "PNG")
    assert decode_image(data, max_pixels=64 * 48).shape == (48, 64, 3)
    with pytest.raises(ImageError, match="64x48 pixels; the limit is 3071 pixels"):
        decode_image(data, max_pixels=64 * 48 - 1)
    with pytest.raises(ImageError, match="could not be decoded"):
        decode_image(data[:40], max_pixels=BIG)


def test_an_image_past_200_to_1_is_refused():
    """The Qwen vision processors refuse a long side over 200 times the short one (smart_resize):
    refused before any stage sees it; 200:1 itself passes."""
    assert decode_image(_encode(Image.new("RGB", (400, 2)), "PNG"), max_pixels=BIG).shape == (2, 400, 3)
    with pytest.raises(ImageError, match="1x201 pixels: its long side may be at most 200 times"):
        decode_image(_encode(Image.new("RGB", (1, 201)), "PNG"), max_pixels=BIG)


def test_a_requests_media_are_held_to_a_decoded_byte_budget():
    """A small file can decode large (one colour: a few hundred bytes of PNG, 3 bytes a pixel), and
    without limit_mm_per_prompt nothing else bounds the parts: past server.max_media_bytes in all,
    400 naming the part, before any later part is decoded."""
    import asyncio
    import base64

    from omni_server.api.errors import APIError
    from omni_server.api.media import decode_media
    from omni_server.api.protocol import ChatCompletionRequest
    from omni_server.config.loader import load_config_text

    buf = io.BytesIO()
    Image.new("RGB", (100, 100), (200, 10, 10)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert len(url) < 1000  # (30,000 bytes decoded)
    cfg = load_config_text("model: m\nserver: {max_media_bytes: 70000}\n"
                           "stages: [{id: 0, name: lm, model: x, output: text}]\n")
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 3
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": parts}])
    with pytest.raises(APIError) as exc:
        asyncio.run(decode_media(cfg, body))
    assert exc.value.status == 400 and exc.value.param == "messages"
    assert exc.value.message == ("the request's media decode to more than 70000 bytes (server.max_media_bytes), "
                                 "at image_url 2")
    two = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": parts[:2]}])
    media = asyncio.run(decode_media(cfg, two))
    assert sorted(media) == ["image.0", "image.1"] and media["image.1"].shape == (100, 100, 3)
