"""When `serve` restarts a stage process that exited (or that it killed as hung).

It never gives a stage up: a server left with a stage down for good would answer 503 until someone
restarted it, and a few requests that crash or hang a stage would be enough for that. Instead the
delay doubles with each crash in a row (1, 2, 4, ... s, at most MAX_DELAY_S), and a stage that then
ran HEALTHY_S without crashing starts again from 1 s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

MAX_DELAY_S = 300.0
HEALTHY_S = 600.0
# Crashes in a row from which each one is logged as an error that names the backoff.
LOOPING = 5


@dataclass
class _Record:
    streak: int = 0
    restarted_at: float = 0.0


@dataclass
class RestartPolicy:
    max_delay_s: float = MAX_DELAY_S
    healthy_s: float = HEALTHY_S
    _units: dict[Hashable, _Record] = field(default_factory=dict)

    def crashed(self, unit: Hashable, now: float) -> tuple[float, int]:
        """The delay before restarting `unit`, which exited at `now`, and its crashes in a row."""
        rec = self._units.setdefault(unit, _Record())
        if rec.streak and now - rec.restarted_at >= self.healthy_s:
            rec.streak = 0  # (it ran long enough since its last restart: a new, unrelated crash)
        delay = min(2.0 ** rec.streak, self.max_delay_s)
        rec.streak += 1
        rec.restarted_at = now + delay
        return delay, rec.streak
