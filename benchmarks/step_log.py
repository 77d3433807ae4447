"""Step time against batch size, from the stages' OMNI_STEP_LOG files (omni_server/stage/profiling.py).

    python benchmarks/step_log.py DIR [--json OUT]

Per stage: its steps that advanced requests (their count and seconds), grouped by how many they advanced (one row per batch
size, or per range of them past 8): how many, median and p90 ms, and median ms per request. Under
spread-out arrivals this is what a batching decision trades: a bigger pass costs more, but less per
request.
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


def summarise(path: Path) -> dict:
    by: dict[str, list[tuple[int, float]]] = {}
    total, busy = 0, 0.0
    for line in path.read_text().splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) != 4:  # (a process's header; a line cut short by a kill)
            continue
        n, t = int(fields[2]), float(fields[3])
        if n:  # (steps that only told the engine of finished requests are left out)
            total += 1
            busy += t
            by.setdefault(_bucket(n), []).append((n, t))
    rows = []
    for key in sorted(by, key=lambda k: int(k.split("-")[0])):
        ns, ts = [n for n, _ in by[key]], sorted(t for _, t in by[key])
        rows.append({"served": key, "steps": len(ts), "ms_p50": round(statistics.median(ts), 2),
                     "ms_p90": round(ts[math.ceil(0.9 * len(ts)) - 1], 2),  # nearest rank
                     "ms_per_request_p50": round(statistics.median(t / n for n, t in by[key]), 2),
                     "mean_served": round(sum(ns) / len(ns), 2)})
    return {"steps": total, "step_s": round(busy / 1e3, 3), "by_served": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    out = {p.stem: summarise(p) for p in sorted(args.dir.glob("*.steps"))}
    for stage, s in out.items():
        print(f"{stage}: {s['steps']} steps, {s['step_s']} s in steps")
        for r in s["by_served"]:
            print(f"  {r['served']:>6} requests: {r['steps']:5d} steps, {r['ms_p50']:8.2f} ms p50, {r['ms_p90']:8.2f} p90, "
                  f"{r['ms_per_request_p50']:7.2f} ms a request")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
