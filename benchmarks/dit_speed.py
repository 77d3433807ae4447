"""The Qwen2.5-Omni DiT body alone (22 layers + output projection, one velocity evaluation): how long
its block-by-block compile takes (`compile: blocks`, first call), and a call compiled and eager.

    python benchmarks/dit_speed.py --model /tmp/omni7b [--rows 2] [--device cpu]

`--model`: a checkpoint dir (benchmarks/qwen2_5_omni_shape.py writes the 7B shape). The inputs are
those of the widest streaming window (`frame_buckets[-1]` frames) for `--rows` requests with
classifier-free guidance (2 x rows). Run each version with its own empty Inductor cache
(TORCHINDUCTOR_CACHE_DIR) for a cold compile time. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from omni_server.models.qwen2_5_omni import token2wav


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    t = token2wav.Token2Wav(a.model, a.device)
    seen = []
    body = t._dit_body
    t._dit_body = lambda *args: seen.append(args) or body(*args)  # (records one call's inputs)
    torch.manual_seed(0)

    def timed(fn) -> float:
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if a.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.inference_mode():
        frames = t.frame_buckets[-1]
        t._sample_mels([torch.zeros(frames // t.dit.repeats, dtype=torch.long)] * a.rows, [t.voices[0]] * a.rows,
                       [torch.randn(frames, t.dit.mel_dim)] * a.rows, t._time_grid(2, -1.0), 0.5)
        args = seen[0]
        block = torch.compile(token2wav.run_layer, dynamic=True)
        compile_s = timed(lambda: body(*args, block=block))
        compiled = [timed(lambda: body(*args, block=block)) for _ in range(a.repeats)]
        eager = [timed(lambda: body(*args)) for _ in range(a.repeats)]
    print(json.dumps({"frames": frames, "rows": int(args[0].shape[0]), "device": a.device,
                      "first_call_s": round(compile_s, 1), "compiled_ms": round(statistics.median(compiled) * 1e3, 1),
                      "eager_ms": round(statistics.median(eager) * 1e3, 1)}))


if __name__ == "__main__":
    main()
