"""A cost MODEL of token2wav's streamed passes under Poisson arrivals, to compare pass policies
(omni_server/stage/stream_order.py vs taking every ready stream); not a measurement. Numbers come
from the device (session step `rate`); this only shows which way a policy moves them.

    python benchmarks/stream_order_sim.py --scale 1.3 --rate 3

Model: 32 requests of 500 codes (10 s of audio), at most 16 at once; a request's codes start
0.2 s after admission, one per talker step of 3 + 0.2 x (streams talking) ms; the 7B config's
windows (48, 48, 72, 96 then 144 new frames, 48 past, 24 future); a pass over `rows` streams
(padded to a power of two) of the widest span costs scale x (40 + 22 x rows x span / 216) ms
(H200: 67 ms a window at batch 1, ~400 ms a batch-16 216-frame pass beside the other stages;
scale 1.3 matched the 2026-12-02 `rate` run's saturation: first audio 1.2 s, RTF ~0.55).
"""

from __future__ import annotations

import argparse
import random

from omni_server.models.windows import window_at
from omni_server.stage.stream_order import Playback, pick

WINDOWS, CHUNK, PAST, FUTURE, FRAMES_PER_S, CODES, REPEATS = [48, 48, 72, 96], 144, 48, 24, 100, 500, 2
SIZES = [1, 2, 4, 8, 16]


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _chunk(settled: int) -> int:
    return window_at(settled, tuple(WINDOWS), CHUNK)


def simulate(policy: str, rate: float, scale: float, seed: int, n: int = 32, cap: int = 16) -> dict:
    rnd, t, arrivals = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rnd.expovariate(rate)
        arrivals.append(t)
    streams: dict[str, dict] = {}
    playback, now, pass_s, results = Playback(), 0.0, 0.0, []
    total = CODES * REPEATS
    while len(results) < n:
        while arrivals and arrivals[0] <= now and len(streams) < cap:
            rid = f"r{len(arrivals)}"
            streams[rid] = dict(arrived=arrivals.pop(0), t0=now + 0.2, end=now + 0.2 + CODES * 0.004,
                                settled=0, first=None, sent=0.0, stall=0.0)
            playback.open(rid, now)
        talking = sum(1 for s in streams.values() if s["end"] > now) or 1
        ready = []
        for rid, st in streams.items():
            codes = 0 if now < st["t0"] else min(CODES, int((now - st["t0"]) / (0.003 + 0.0002 * talking)))
            if codes >= CODES or st["settled"] + _chunk(st["settled"]) + FUTURE <= codes * REPEATS:
                ready.append(rid)
        if not ready:
            now += 0.005
            continue
        if policy == "all":  # every ready stream, round robin
            rids = ready[:16]
        else:
            rids = pick(ready, {r: playback.slack(r, now) for r in ready}, 16, SIZES, 2 * pass_s)
        sizes = {r: min(_chunk(streams[r]["settled"]), total - streams[r]["settled"]) for r in rids}
        span = max(min(streams[r]["settled"], PAST) + sizes[r] + FUTURE for r in rids)
        took = scale * (0.040 + 0.022 * _pow2(len(rids)) * span / 216)
        now += took
        pass_s = max(took, 0.9 * pass_s)  # (as the stage: the longest pass of late)
        for r in rids:
            st = streams[r]
            if st["first"] is None:
                st["first"] = now
            else:
                st["stall"] = max(st["stall"], now - (st["first"] + st["sent"]))
            st["settled"] += sizes[r]
            st["sent"] += sizes[r] / FRAMES_PER_S
            playback.sent(r, sizes[r] / FRAMES_PER_S, now)
            if st["settled"] >= total:
                results.append((st["first"] - st["arrived"], now - st["arrived"], st["stall"]))
                del streams[r]
                playback.forget(r)
            elif policy == "all":
                streams[r] = streams.pop(r)
    ttfp, latency, stall = (sorted(x[i] for x in results) for i in range(3))
    return {"policy": policy, "seed": seed, "ttfp_ms_p50": round(ttfp[n // 2] * 1000),
            "ttfp_ms_p90": round(ttfp[int(n * 0.9)] * 1000), "rtf_p50": round(latency[n // 2] / (CODES / 50), 3),
            "stall_ms_p90": round(stall[int(n * 0.9)] * 1000)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    for rate in args.rate:
        for policy in ("all", "stream_order"):
            for seed in range(args.seeds):
                print({"rate": rate, **simulate(policy, rate, args.scale, seed)})


if __name__ == "__main__":
    main()
