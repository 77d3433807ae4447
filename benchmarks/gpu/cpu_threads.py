"""CPU seconds per thread of some processes over a span: is a stage's step host-bound, and which
thread burns the time (its Python loop, a spinning CUDA wait, a library's worker pool)?

    python3 benchmarks/gpu/cpu_threads.py snap PID... > a.json     # before
    python3 benchmarks/gpu/cpu_threads.py snap PID... > b.json     # after
    python3 benchmarks/gpu/cpu_threads.py diff a.json b.json       # seconds each thread used between
"""

from __future__ import annotations

import json
import os
import sys
import time


def _ticks(stat_path: str) -> tuple[str, int]:
    with open(stat_path) as f:
        s = f.read()
    # comm is in parentheses and may hold spaces: the fields after it are space-separated.
    name = s[s.index("(") + 1 : s.rindex(")")]
    fields = s[s.rindex(")") + 2 :].split()
    return name, int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of stat)


def snap(pids: list[int]) -> dict:
    out = {"t": time.monotonic(), "hz": os.sysconf("SC_CLK_TCK"), "procs": {}}
    for pid in pids:
        threads = {}
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    threads[tid] = _ticks(f"/proc/{pid}/task/{tid}/stat")
                except OSError:
                    pass
        except OSError:
            continue
        out["procs"][str(pid)] = threads
    return out


def diff(a: dict, b: dict) -> str:
    span, hz = b["t"] - a["t"], b["hz"]
    lines = [f"{span:.2f} s wall"]
    for pid, threads in b["procs"].items():
        before = a["procs"].get(pid, {})
        used = []
        for tid, (name, ticks) in threads.items():
            d = (ticks - before.get(tid, (name, 0))[1]) / hz
            if d > 0:
                used.append((d, tid, name))
        total = sum(u[0] for u in used)
        lines.append(f"pid {pid}: {total:.2f} CPU s ({total / span:.2f} cores)")
        for d, tid, name in sorted(used, reverse=True)[:8]:
            lines.append(f"  {name:<24} tid {tid:<8} {d:6.2f} s ({d / span:.2f} of wall)")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "snap":
        print(json.dumps(snap([int(p) for p in sys.argv[2:]])))
    else:
        print(diff(json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))))
