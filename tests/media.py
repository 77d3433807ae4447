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
