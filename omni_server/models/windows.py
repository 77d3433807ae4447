"""Streaming decoders' window sizes: a few first windows of their own sizes, then fixed chunks."""

from __future__ import annotations


def window_at(start: int, first: tuple[int, ...], chunk: int) -> int:
    """New frames of the window that starts at frame `start` (a sum of the windows before it):
    `first`'s sizes in order, then `chunk` each. Window ends depend on the frames alone, never on
    when they arrived."""
    done = 0
    for size in first:
        if start == done:
            return size
        done += size
    return chunk
