"""Sum py-spy's raw (collapsed-stack) samples of one process: the share of samples in which each
function is on the stack (inclusive) and at the top (self), per thread root.

    python3 benchmarks/gpu/spy_top.py /tmp/res/spy/c16_stage1.txt [--top 40] [--under FUNC]

`--under FUNC`: only the samples whose stack passes through FUNC (e.g. `ARStage.step`), with shares
of those.
"""

from __future__ import annotations

import argparse
import collections


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py:123)"
    if " (" in frame and frame.endswith(")"):
        name, where = frame[:-1].split(" (", 1)
        return f"{name} ({where.rsplit('/', 1)[-1]})"
    return frame


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--under", default=None)
    a = ap.parse_args()
    inclusive: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    total = 0
    for line in open(a.path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        frames = [_short(f) for f in stack.split(";")]
        if a.under is not None:
            hit = next((i for i, f in enumerate(frames) if f.startswith(a.under + " ")), None)
            if hit is None:
                continue
            frames = frames[hit:]
        count = int(n)
        total += count
        for f in set(frames):
            inclusive[f] += count
        leaf[frames[-1]] += count
    print(f"{total} samples" + (f" under {a.under}" if a.under else ""))
    print("inclusive:")
    for f, c in inclusive.most_common(a.top):
        print(f"  {c / total:6.1%}  {f}")
    print("self:")
    for f, c in leaf.most_common(a.top // 2):
        print(f"  {c / total:6.1%}  {f}")


if __name__ == "__main__":
    main()
