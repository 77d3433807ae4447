"""Step time against batch size, from the stages' OMNI_STEP_LOG files (omni_server/stage/profiling.py).

    python benchmarks/step_log.py DIR [--bench BENCH.json] [--json OUT]

Per stage: its steps that advanced requests (their count, seconds, mean batch and median ms), and
those grouped by how many requests they advanced (one row per batch size, or per range of them past
8): how many, median and p90 ms, and median ms per request. Under spread-out arrivals this is what a
batching decision trades: a bigger pass costs more, but less per request. `--bench`: only the steps
that started during that `omni-server bench` output's first level (its `started_at`, `wall_s`), with
the busy fraction of that time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def _bucket(n: int) -> str:
    if n <= 8:
        return str(n)
    lo = 8 * ((n - 1) // 8) + 1
    return f"{lo}-{lo + 7}"


def summarise(path: Path, window: tuple[float, float] | None = None) -> dict:
    by: dict[str, list[tuple[int, float]]] = {}
    total, busy, served, times = 0, 0.0, 0, []
    for line in path.read_text().splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) != 4:  # (a process's header; a line cut short by a kill)
            continue
        start, n, t = float(fields[0]), int(fields[2]), float(fields[3])
        if window and not window[0] <= start < window[1]:
            continue
        if n:  # (steps that only told the engine of finished requests are left out)
            total += 1
            busy += t
            served += n
            times.append(t)
            by.setdefault(_bucket(n), []).append((n, t))
    rows = []
    for key in sorted(by, key=lambda k: int(k.split("-")[0])):
        ns, ts = [n for n, _ in by[key]], sorted(t for _, t in by[key])
        rows.append({"served": key, "steps": len(ts), "ms_p50": round(statistics.median(ts), 2),
                     "ms_p90": round(ts[math.ceil(0.9 * len(ts)) - 1], 2),  # nearest rank
                     "ms_per_request_p50": round(statistics.median(t / n for n, t in by[key]), 2),
                     "mean_served": round(sum(ns) / len(ns), 2)})
    out = {"steps": total, "step_s": round(busy / 1e3, 3), "mean_served": round(served / total, 2) if total else None,
           "ms_p50": round(statistics.median(times), 2) if times else None}
    if window:
        out["busy"] = round(busy / 1e3 / (window[1] - window[0]), 3)
    return out | {"by_served": rows}


def bench_window(path: Path) -> tuple[float, float]:
    """The Unix-time span of a bench output's first level."""
    level = json.loads(path.read_text())["levels"][0]
    return level["started_at"], level["started_at"] + level["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--bench", type=Path, help="only the steps during this bench output's first level")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    window = bench_window(args.bench) if args.bench else None
    out = {p.stem: summarise(p, window) for p in sorted(args.dir.glob("*.steps"))}
    for stage, s in out.items():
        print(f"{stage}: {s['steps']} steps of {s['mean_served']} requests, {s['ms_p50']} ms p50, {s['step_s']} s"
              + (f" (busy {s['busy']})" if window else ""))
        for r in s["by_served"]:
            print(f"  {r['served']:>6} requests: {r['steps']:5d} steps, {r['ms_p50']:8.2f} ms p50, {r['ms_p90']:8.2f} p90, "
                  f"{r['ms_per_request_p50']:7.2f} ms a request")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
