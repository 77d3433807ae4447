"""Images in chat requests: `data:` URLs decoded to RGB arrays, with size limits, never fetched."""

from __future__ import annotations

import base64
import binascii
import io
import re

import numpy as np

_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp|gif|bmp);base64,", re.IGNORECASE)


class ImageError(ValueError):
    """An image the server will not take; the message is safe to show to the client."""


def decode_image_url(url: str, *, max_bytes: int, max_pixels: int) -> np.ndarray:
    """RGB uint8 [height, width, 3] of a base64 `data:image/...` URL."""
    from PIL import Image

    m = _DATA_URL.match(url)
    if m is None:
        if url.startswith(("http://", "https://")):
            raise ImageError("remote image URLs are not fetched; send the image as a data:image/...;base64 URL")
        raise ImageError("image_url must be a data:image/(png|jpeg|webp|gif|bmp);base64,... URL")
    payload = url[m.end():]
    if len(payload) * 3 // 4 > max_bytes:
        raise ImageError(f"image is larger than the limit of {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image data is not valid base64") from None
    try:
        with Image.open(io.BytesIO(data)) as img:
            # The header's size, checked before any pixel is decoded (decompression bombs).
            width, height = img.size
            if width * height > max_pixels:
                raise ImageError(f"image is {width}x{height} pixels; the limit is {max_pixels} pixels")
            if width == 0 or height == 0:
                raise ImageError("image has no pixels")
            rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)
    except ImageError:
        raise
    except Exception:
        raise ImageError("image data could not be decoded") from None
    return np.ascontiguousarray(rgb)
