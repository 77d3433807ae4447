"""Model of token2wav's streaming windows at c=1: when the first audio comes and how long a player that
starts at the first packet pauses, for a list of first window sizes (`first_chunk_frames`).

    python benchmarks/window_schedule.py --talker-first-ms 60 --code-ms 9 --window-ms 100 --starts 72 48,48 24,48

Codes arrive one per `--code-ms` after `--talker-first-ms`; a window of n new frames runs once its
frames plus `future` frames of codes are in (2 frames per code) and the previous window is done,
taking `--window-ms`; it makes playable all settled frames but the `ctx` the vocoder holds back
(10 ms of audio per frame). Fitted to the 2026-11-30c H200 run (talker first 130 ms, 9.5 ms per
code, 150 ms per window), it gives 726 ms TTFP for [72] (measured 761) and 498 ms + 302 ms of
stalls for [24] (measured 495 + 355). Fitted to the 2026-12-05 H100 run (twenty-fifth; talker
first 41 ms, 8.5 ms per code: at c=1 the talker's codes come at the thinker's pace, 110 ms per
window, `--chunk 144`), 448 ms for [48,48,72,96] (measured 452) and 346 ms + 70 ms of pauses for
[24,24,48,72,96] (measured 350 ms, pauses p90 ~100 ms).
"""

from __future__ import annotations

import argparse


def schedule(starts: list[int], talker_first_ms: float, code_ms: float, window_ms: float, codes: int = 500,
             chunk: int = 72, future: int = 24, ctx: int = 20) -> tuple[float, float]:
    """(time of the first audio, total playback pause) in ms."""
    total, settled, free, k, pieces = codes * 2, 0, 0.0, 0, []
    while settled < total:
        size = starts[k] if k < len(starts) else chunk
        k += 1
        end = settled + size + future
        if end > total:
            size, end = total - settled, total
        ready = talker_first_ms + ((end + 1) // 2 - 1) * code_ms
        free = max(ready, free) + window_ms
        settled += size
        pieces.append((free, settled if settled == total else settled - ctx))
    first, playable = pieces[0]
    runs_out, stall = first + playable * 10, 0.0
    for done, now in pieces[1:]:
        if done > runs_out:
            stall, runs_out = stall + done - runs_out, done
        runs_out += (now - playable) * 10
        playable = now
    return first, stall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--talker-first-ms", type=float, default=60.0)
    p.add_argument("--code-ms", type=float, default=9.0)
    p.add_argument("--window-ms", type=float, default=100.0)
    p.add_argument("--chunk", type=int, default=144, help="chunk_frames: the windows after the first ones")
    p.add_argument("--starts", nargs="+", default=["72", "48", "24", "24,48", "48,48", "24,24,48"])
    a = p.parse_args()
    for s in a.starts:
        first, stall = schedule([int(x) for x in s.split(",")], a.talker_first_ms, a.code_ms, a.window_ms,
                                chunk=a.chunk)
        print(f"first_chunk_frames [{s}]: first audio {first:.0f} ms, pauses {stall:.0f} ms, "
              f"smooth from {first + stall:.0f} ms")


if __name__ == "__main__":
    main()
