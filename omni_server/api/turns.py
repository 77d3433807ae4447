"""Where a speaker's turn starts and ends in a stream of PCM16 audio (the Realtime API's
`server_vad`): a level gate on 20 ms frames, no model.

A frame is speech when its RMS level is above `-60 + 50 * threshold` dBFS (threshold 0.5: -35 dBFS,
quiet speech at a normal distance; 0: -60, 1: -10) and 9 dB above the noise floor: the quietest
recent level, which follows a quieter frame at once and rises 5 dB a second, so a steady sound (a
fan, a hum) stops counting as speech within seconds while speech, never without pauses for long,
keeps its floor low. A turn starts at the first of two speech frames in a row (one click is not a
turn) and ends after `silence_ms` without speech. Positions are samples since the stream began, so
the caller can cut its own buffer.
"""

from __future__ import annotations

import numpy as np

_FRAME_S = 0.02
_START_FRAMES = 2  # speech frames in a row that open a turn
_ABOVE_FLOOR_DB = 9.0
_FLOOR_RISE_DB = 5.0 * _FRAME_S  # a frame
_FLOOR_MIN_DB = -100.0


def level_db(threshold: float) -> float:
    """The RMS level (dBFS) above which a frame is speech."""
    return -60.0 + 50.0 * threshold


class TurnDetector:
    def __init__(self, rate: int, threshold: float = 0.5, silence_ms: int = 500, at: int = 0):
        self.frame = int(rate * _FRAME_S)
        # Samples a start lies behind the audio that reveals it (its frames, and a partial one held over).
        self.lookback = (_START_FRAMES + 1) * self.frame
        self.gate_db = level_db(threshold)
        self.floor_db = _FLOOR_MIN_DB
        self.quiet_to_stop = max(1, round(silence_ms / 1000 / _FRAME_S))
        self.heard = at  # samples fed so far (`at`: the stream's position when this detector joins it)
        self.rest = np.zeros(0, dtype=np.int16)  # (a partial frame, carried to the next feed)
        self.speaking = False
        self.loud_run = 0  # speech frames in a row (before a turn starts)
        self.quiet_run = 0  # frames without speech in a row (in a turn)

    def end(self) -> None:
        """The turn (if any) is over without a stop: the caller committed or cleared the audio."""
        self.speaking, self.loud_run, self.quiet_run = False, 0, 0

    def feed(self, pcm: bytes) -> list[tuple[str, int]]:
        """Audio in; out, in order, ("started", sample where speech began) and ("stopped", sample
        where the turn ends: after its trailing silence)."""
        samples = np.concatenate([self.rest, np.frombuffer(pcm, dtype="<i2")])
        start = self.heard - len(self.rest)  # (the sample index of samples[0])
        self.heard += len(pcm) // 2
        n = len(samples) // self.frame
        self.rest = samples[n * self.frame:].copy()
        if n == 0:
            return []
        frames = samples[:n * self.frame].astype(np.float32).reshape(n, self.frame)
        levels = 10 * np.log10(np.maximum((frames * frames).mean(axis=1), 1e-10) / 32768.0 ** 2)
        events = []
        for k, db in enumerate(levels.tolist()):
            self.floor_db = max(_FLOOR_MIN_DB, min(db, self.floor_db + _FLOOR_RISE_DB))
            is_loud = db > self.gate_db and db > self.floor_db + _ABOVE_FLOOR_DB
            if not self.speaking:
                self.loud_run = self.loud_run + 1 if is_loud else 0
                if self.loud_run == _START_FRAMES:
                    self.speaking, self.quiet_run = True, 0
                    events.append(("started", start + (k + 1 - _START_FRAMES) * self.frame))
            else:
                self.quiet_run = 0 if is_loud else self.quiet_run + 1
                if self.quiet_run == self.quiet_to_stop:
                    self.end()
                    events.append(("stopped", start + (k + 1) * self.frame))
        return events
