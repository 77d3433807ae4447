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
