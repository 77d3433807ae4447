"""Speech played faster or slower at the same pitch (`/v1/audio/speech`'s `speed`), streamed.

WSOLA (waveform-similarity overlap-add): the output is built from Hann-windowed frames of the input
laid down every `hop` samples, the k-th taken near input position k * hop * speed. Each frame is
moved within +-`tolerance` of that position to where it best continues the frame before it
(normalised cross-correlation with the input that naturally follows the previous frame), so pitch
periods line up and the voice keeps its pitch; only the tempo changes. Works piece by piece: a frame
is made once every input sample its choice can look at has arrived, so the output is the same
however the input is split (`push` / `flush`), and `speed` = 1 is never run through it (the caller's
choice: this would be a near-identity copy).
"""

from __future__ import annotations

import numpy as np

FRAME_S = 0.030  # 30 ms frames (a few pitch periods of a voice), half overlapping
TOLERANCE_S = 0.010  # how far a frame may move: more than the longest pitch period expected (~8 ms)


class TimeStretch:
    def __init__(self, sample_rate: int, speed: float):
        if not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be within [0.25, 4.0], got {speed}")
        self.speed = speed
        self.hop = max(int(round(FRAME_S * sample_rate / 2)), 1)
        self.frame = 2 * self.hop
        self.tolerance = int(round(TOLERANCE_S * sample_rate))
        # Periodic Hann: copies `hop` apart sum to exactly 1.
        self.window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(self.frame) / self.frame)).astype(np.float32)
        # The input from absolute position `start` on, after `hop` zeros: frame 0 (on the zeros and
        # the first `hop` samples) gives the first samples their other half-window; its first half,
        # silence, is not output. Frame k >= 1 starts near input sample (k - 1) * hop * speed.
        self.buf = np.zeros(self.hop, np.float32)
        self.start = 0
        self.received = 0  # input samples pushed
        self.returned = 0  # output samples returned
        self.k = 0  # next frame
        self.prev = 0  # (padded) input position of the previous frame
        self.tail = np.zeros(self.frame, np.float32)  # output from frame k's start on, partly summed
        self.lead = True  # frame 0's first half (the silence before the input) not yet dropped
        # Output made but held back: never more than len(input) / speed goes out before `flush`
        # (above speed ~2.7 a frame can be made before that much input is here).
        self.pending = np.zeros(0, np.float32)

    def push(self, samples) -> np.ndarray:
        """Add input; returns the output that is now final."""
        x = np.nan_to_num(np.asarray(samples, np.float32).reshape(-1))
        self.received += x.size
        self.buf = np.concatenate([self.buf, x])
        made = np.concatenate([self.pending, self._out(self._frames(final=False))])
        n = max(min(made.size, int(self.received / self.speed) - self.returned), 0)
        self.pending = made[n:]
        self.returned += n
        return made[:n]

    def flush(self) -> np.ndarray:
        """No more input: the rest of the output, round(len(input) / speed) samples in all."""
        total = int(round(self.received / self.speed))
        # Silence after the input lets the last frames be chosen as if it went on quiet.
        self.buf = np.concatenate([self.buf, np.zeros(2 * (self.frame + self.tolerance), np.float32)])
        rest = np.concatenate([self.pending, self._out(self._frames(final=True)), self.tail[:self.hop]])
        keep = total - self.returned
        if keep <= rest.size:
            rest = rest[:max(keep, 0)]
        else:
            rest = np.concatenate([rest, np.zeros(keep - rest.size, np.float32)])
        self.returned += rest.size
        return rest

    def _nominal(self, k: int) -> int:
        return 0 if k == 0 else int(round(self.hop + (k - 1) * self.hop * self.speed))

    def _frames(self, final: bool) -> list[np.ndarray]:
        end = self.start + self.buf.size  # (padded) position where what is here ends
        out = []
        while True:
            nominal = self._nominal(self.k)
            if final and nominal > self.hop + self.received:  # past the input: silence
                break
            lo, hi = max(nominal - self.tolerance, 0), nominal + self.tolerance
            if final and self.speed < 1:
                # Slowed down, a frame over the silence after the input would play part of it
                # before the end (a fade-out): the last frames stay on the input. (Faster, that part
                # falls after the end. Only the flush's frames reach that far.)
                last = max(self.hop + self.received - self.frame, 0)
                nominal, hi = min(nominal, last), min(hi, last)
                lo = min(lo, hi)
            natural = self.prev + self.hop  # where the previous frame's input goes on
            if self.k > 0 and max(hi, natural) + self.frame > end or nominal + self.frame > end:
                break  # (its input is not all here yet)
            pos = nominal if self.k == 0 else self._best(lo, hi, natural, nominal)
            self.tail += self.window * self.buf[pos - self.start:pos - self.start + self.frame]
            out.append(self.tail[:self.hop].copy())
            self.tail = np.concatenate([self.tail[self.hop:], np.zeros(self.hop, np.float32)])
            self.prev, self.k = pos, self.k + 1
        # Input no later frame can look at is dropped (nor the last frame's worth: the flush's frames
        # may be held back onto it).
        keep_from = max(min(self._nominal(self.k), self.hop + self.received - self.frame) - self.tolerance, 0)
        keep_from = min(keep_from, self.prev + self.hop)
        if keep_from > self.start:
            self.buf = self.buf[keep_from - self.start:]
            self.start = keep_from
        return out

    def _out(self, pieces: list[np.ndarray]) -> np.ndarray:
        if self.lead and pieces:
            pieces, self.lead = pieces[1:], False
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    def _best(self, lo: int, hi: int, natural: int, nominal: int) -> int:
        """The frame start in [lo, hi] whose input best matches what follows the previous frame."""
        template = self.buf[natural - self.start:natural - self.start + self.frame].astype(np.float64)
        region = self.buf[lo - self.start:hi - self.start + self.frame].astype(np.float64)
        corr = np.correlate(region, template, mode="valid")  # one per candidate start
        energy = np.concatenate([[0.0], np.cumsum(region * region)])
        norms = np.sqrt(np.maximum(energy[self.frame:] - energy[:-self.frame], 0.0))
        if not (norms > 1e-9).any() or not template.any():  # silence: keep to the tempo
            return nominal
        score = np.where(norms > 1e-9, corr / np.maximum(norms, 1e-9), -np.inf)
        return lo + int(np.argmax(score))
