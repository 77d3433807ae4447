"""Images in chat requests (`data:` URLs, or fetched bytes: api/fetch.py) decoded to RGB arrays, with
size limits."""

from __future__ import annotations

import io
import re

import numpy as np

from omni_server.api.data_url import payload

_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp|gif|bmp);base64,", re.IGNORECASE)


_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# The longest side over the shortest an image may have: the vision processors served here resize an
# image to a grid of patches and refuse past 200 (Qwen's); refused up front, in every route.
MAX_ASPECT_RATIO = 200


class ImageError(ValueError):
    """An image the server will not take; the message is safe to show to the client."""


def image_data_url(url: str, *, max_bytes: int) -> bytes:
    """The file bytes of a base64 `data:image/...` URL."""
    return payload(url, _DATA_URL, kind="image", accepted="data:image/(png|jpeg|webp|gif|bmp);base64,...",
                   max_bytes=max_bytes, error=ImageError)


def decode_image(data: bytes, *, max_pixels: int) -> np.ndarray:
    """RGB uint8 [height, width, 3] of an image file's bytes."""
    from PIL import Image, ImageOps

    try:
        # (only the formats the data: URLs name; a phone's MPO opens as JPEG)
        with Image.open(io.BytesIO(data), formats=_FORMATS) as img:
            # The header's size, checked before any pixel is decoded (decompression bombs).
            width, height = img.size
            if width * height > max_pixels:
                raise ImageError(f"image is {width}x{height} pixels; the limit is {max_pixels} pixels")
            if width == 0 or height == 0:
                raise ImageError("image has no pixels")
            if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
                raise ImageError(f"image is {width}x{height} pixels: its long side may be at most "
                                 f"{MAX_ASPECT_RATIO} times its short one")
            # Upright as a viewer shows it (a phone stores a portrait photo sideways, with an EXIF
            # orientation), as vLLM's and transformers' image loaders do.
            rgb = np.asarray(ImageOps.exif_transpose(img).convert("RGB"), dtype=np.uint8)
    except ImageError:
        raise
    except Exception:
        raise ImageError("image data could not be decoded") from None
    return np.ascontiguousarray(rgb)
