"""The Qwen2.5-Omni DiT body alone (22 layers + output projection, one velocity evaluation): how long
its block-by-block compile takes (`compile: blocks`, first call), and a call compiled and eager.

    python benchmarks/dit_speed.py --model /tmp/omni7b [--rows 2] [--device cpu]

`--model`: a checkpoint dir (benchmarks/qwen2_5_omni_shape.py writes the 7B shape). The inputs are
those of the widest streaming window (`frame_buckets[-1]` frames) for `--rows` requests with
classifier-free guidance (2 x rows). Run each version with its own empty Inductor cache
(TORCHINDUCTOR_CACHE_DIR) for a cold compile time. Prints one JSON line.

`--variants` (an experiment, CUDA only; one JSON line each, with `max_rel_err` of the output against
the plain compiled call): `autotune` compiles with Inductor's max-autotune (Triton GEMM templates
with fused epilogues); `qkv` one projection GEMM for queries, keys and values (`dit_fused_qkv`);
`fp8` runs the layers' linear projections as FP8 GEMMs (weights per output
channel, activations per row, scaled to e4m3 on the fly; `torch._scaled_mm`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from omni_server.models.qwen2_5_omni import token2wav
from omni_server.models.qwen2_5_omni.dit import fuse_qkv


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", nargs="*", default=[], choices=["autotune", "qkv", "fp8"])
    a = p.parse_args()
    # (as the 7B configs run it; no graphs: they would bind the body at start)
    t = token2wav.Token2Wav(a.model, a.device, cuda_graphs=False, dit_dtype="bfloat16", tf32=True)
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

    def replayed_ms(fn) -> float | None:
        """GPU time of one call replayed as a CUDA graph (as served: no launch overhead), median ms."""
        if a.device != "cuda":
            return None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times = []
        for _ in range(a.repeats * 4):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return round(statistics.median(times), 2)

    with torch.inference_mode():
        frames = t.frame_buckets[-1]
        t._sample_mels([torch.zeros(frames // t.dit.repeats, dtype=torch.long)] * a.rows, [t.voices[0]] * a.rows,
                       [torch.randn(frames, t.dit.mel_dim)] * a.rows, t._time_grid(2, -1.0), 0.5)
        args = seen[0]
        block = torch.compile(token2wav.run_layer, dynamic=True)
        compile_s = timed(lambda: body(*args, block=block))
        compiled = [timed(lambda: body(*args, block=block)) for _ in range(a.repeats)]
        eager = [timed(lambda: body(*args)) for _ in range(a.repeats)]
        reference = body(*args, block=block).float()
        graph_ms = replayed_ms(lambda: body(*args, block=block))
    print(json.dumps({"frames": frames, "rows": int(args[0].shape[0]), "device": a.device,
                      "first_call_s": round(compile_s, 1), "compiled_ms": round(statistics.median(compiled) * 1e3, 1),
                      "eager_ms": round(statistics.median(eager) * 1e3, 1), "graph_ms": graph_ms}), flush=True)
    # (in this order: qkv adds a stacked projection the later ones use; fp8 converts the layers)
    for variant in sorted(a.variants, key=["autotune", "qkv", "fp8"].index):
        torch._dynamo.reset()
        if variant == "fp8":
            for layer in t.dit.transformer_blocks:
                _to_fp8(layer)
            block = torch.compile(token2wav.run_layer, dynamic=True)
        elif variant == "qkv":
            fuse_qkv(t.dit)
            block = torch.compile(token2wav.run_layer, dynamic=True)
        else:
            block = torch.compile(token2wav.run_layer, dynamic=True, mode="max-autotune-no-cudagraphs")
        with torch.inference_mode():
            compile_s = timed(lambda: body(*args, block=block))
            times = [timed(lambda: body(*args, block=block)) for _ in range(a.repeats)]
            err = ((body(*args, block=block).float() - reference).abs().max() / reference.abs().max()).item()
            graph_ms = replayed_ms(lambda: body(*args, block=block))
        print(json.dumps({"variant": variant, "frames": frames, "rows": int(args[0].shape[0]),
                          "first_call_s": round(compile_s, 1), "compiled_ms": round(statistics.median(times) * 1e3, 1),
                          "graph_ms": graph_ms, "max_rel_err": round(err, 5)}), flush=True)


class _Fp8Linear(torch.nn.Module):
    """y = x W^T + b with W in e4m3 (one scale per output channel) and x cast per row at each call."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        self.weight = torch.nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.w_scale = torch.nn.Parameter(scale.t().contiguous(), requires_grad=False)  # [1, out]
        self.bias = linear.bias
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        s = flat.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
        q = (flat.float() / s).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(q, self.weight.t(), scale_a=s, scale_b=self.w_scale, bias=self.bias,
                             out_dtype=self.out_dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _to_fp8(module: torch.nn.Module) -> None:
    for name, child in module.named_children():
        if name in ("attn_norm", "ff_norm"):  # (the modulation's projections of one time embedding per row)
            continue
        if isinstance(child, torch.nn.Linear) and child.in_features % 16 == 0 and child.out_features % 16 == 0 \
                and child.in_features >= 512:  # (the attention / MLP projections, not the modulation's small ones)
            setattr(module, name, _Fp8Linear(child))
        else:
            _to_fp8(child)


if __name__ == "__main__":
    main()
