"""Which streams a streamed generation stage advances in its next pass.

A streamed reply's audio plays from its first piece on, in real time. A stream whose audio is far
ahead of its listener can wait; one whose listener still waits for first audio, or is about to run
dry, cannot. So each pass takes the ready streams that are furthest behind first (a stream without
audio yet is as far behind as it has waited). When the generator runs only some pass sizes
without padding (e.g. its CUDA graphs' batch buckets, powers of two), a pass takes the largest such
size, not a padded larger one (under spread-out arrivals a pass of 9 streams padded to 16 costs
about what 16 do), unless that would leave out a stream with too little audio ahead to wait for
another pass, or the padding is at most a quarter of the pass.
"""

from __future__ import annotations

# Pad a pass up to the next size when at least this share of its rows are real streams.
FILL = 0.75


class Playback:
    """Per stream: when it opened, when its playback started (its first audio, moved on by each
    pause: a player that runs dry waits for the next piece) and how many seconds went out."""

    def __init__(self) -> None:
        self._opened: dict[str, float] = {}
        self._first: dict[str, float] = {}
        self._sent: dict[str, float] = {}

    def open(self, rid: str, now: float) -> None:
        self._opened[rid] = now

    def sent(self, rid: str, seconds: float, now: float) -> float:
        """Record a piece of `seconds` of audio sent at `now`; returns how long its listener's audio
        had run dry before it (0.0: none; the first piece never)."""
        if rid not in self._opened or seconds <= 0:
            return 0.0
        first = self._first.setdefault(rid, now)
        dry = max(now - first - self._sent.get(rid, 0.0), 0.0)
        self._first[rid] = first + dry  # (the player paused that long)
        self._sent[rid] = self._sent.get(rid, 0.0) + seconds
        return dry

    def slack(self, rid: str, now: float) -> float:
        """Seconds of audio sent beyond what its listener has played by `now` (negative: behind);
        before any audio, minus the seconds since it opened (its listener waits as long)."""
        first = self._first.get(rid)
        if first is None:
            return -(now - self._opened.get(rid, now))
        return self._sent[rid] - (now - first)

    def forget(self, rid: str) -> None:
        for d in (self._opened, self._first, self._sent):
            d.pop(rid, None)


def pick(ready: list[str], slack: dict[str, float], limit: int, sizes: list[int] | None,
         urgent_s: float) -> list[str]:
    """The streams of the next pass, furthest behind first: at most `limit`; with `sizes` (pass
    sizes that need no padding) the largest that fits, or all up to `limit` when padding to the
    next size wastes at most a quarter of it, and never fewer than the streams with less than
    `urgent_s` of audio ahead (they would run dry waiting for another pass)."""
    order = sorted(ready, key=slack.__getitem__)  # (stable: ties keep arrival order)
    n = min(len(order), limit)
    if sizes:
        fit = max((s for s in sizes if s <= n), default=n)
        above = min((s for s in sizes if s >= n), default=None)
        if above is not None and n >= FILL * above:
            fit = n
        urgent = sum(1 for rid in order[:n] if slack[rid] < urgent_s)
        n = max(fit, urgent)
    return order[:n]
