"""One BigVGAN anti-aliased SnakeBeta activation alone: transformers' module against
omni_server.models.antialias's expression, eager and compiled, and (CUDA) antialias_triton's
kernels, same process, same input.

    python benchmarks/antialias_speed.py --device cpu --batch 16 --channels 96 --length 4000
    python benchmarks/antialias_speed.py --device cuda --batch 16 --channels 768 96 24 --length 2000

Prints one RESULT JSON line per channel count: median ms per call of each (CUDA: synchronized),
and the largest difference from transformers' output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAntiAliasedActivation1d,
    Qwen2_5OmniSnakeBeta,
)

from omni_server.models.antialias import AntiAliasedSnake


def _median_ms(fn, x: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):  # (two unmeasured calls: compile, caches)
        if x.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times[2:]), 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--channels", type=int, nargs="+", default=[96])
    p.add_argument("--length", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    for channels in a.channels:
        act = Qwen2_5OmniAntiAliasedActivation1d(Qwen2_5OmniSnakeBeta(channels)).to(a.device)
        with torch.no_grad():  # (a checkpoint's scale: log-parameters around 0)
            act.act.alpha.copy_(torch.randn(channels, generator=g) * 0.5)
            act.act.beta.copy_(torch.randn(channels, generator=g) * 0.5)
        x = torch.randn(a.batch, channels, a.length, generator=g).to(a.device)
        fused = AntiAliasedSnake(act, channels)
        compiled = AntiAliasedSnake(act, channels, wrap=lambda fn: torch.compile(fn, dynamic=True))
        ours = {"fused_eager_ms": fused, "fused_compiled_ms": compiled}
        if x.is_cuda:
            from omni_server.models.antialias_triton import triton_antialiased_snake

            ours["triton_ms"] = AntiAliasedSnake(act, channels, make=triton_antialiased_snake)
        with torch.inference_mode():
            want = act(x)
            diffs = {k.replace("_ms", "_max_abs_diff"): (m(x) - want).abs().max().item() for k, m in ours.items()}
            result = {"device": a.device, "batch": a.batch, "channels": channels, "length": a.length,
                      "transformers_ms": _median_ms(act, x, a.repeats)} | \
                {k: _median_ms(m, x, a.repeats) for k, m in ours.items()} | diffs
            # Effective bandwidth: x read once and the output written once (8 bytes per element) per
            # time; the two kernels move ~24 (the phases written and read back between them).
            result["triton_effective_gb_s"] = round(2 * x.numel() * 4 / result["triton_ms"] / 1e6, 1) \
                if "triton_ms" in result else None
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
