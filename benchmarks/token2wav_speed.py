"""Token2wav alone: time per streaming DiT window step and real-time factor, eager vs CUDA graphs
vs graphs + TF32 vs graphs + a bfloat16 / float16 DiT (and that with polyphase upsampling in the
vocoder and / or torch.compile), at several batch sizes (streams advanced together), same process, same codes.

    python benchmarks/token2wav_speed.py --model /tmp/omni7b --batch 1 16
    python benchmarks/token2wav_speed.py --model var/models/tiny-qwen2_5-omni --device cpu --modes eager
    python benchmarks/token2wav_speed.py --model /tmp/omni7b --batch 16 --modes config --sdpa cudnn

Each stream gets `--codes` random codec ids (final) and is decoded window by window with
`stream_step` until done (the default window sizes of configs/qwen2_5_omni.yaml); one warm-up
decode per mode and batch first (it also captures the graphs). Prints one RESULT JSON line per
(mode, batch): median ms per step, steps, audio seconds per stream, RTF = wall / audio seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from omni_server.models.qwen2_5_omni.dit import BACKENDS
from omni_server.models.qwen2_5_omni.token2wav import Token2Wav

WINDOWS = dict(chunk_frames=72, first_chunk_frames=72, past_frames=48, future_frames=24, vocoder_context_frames=20)
# The 7B configs' token2wav settings.
# (Their windows, 48, 48, 72, 96, then 144 new frames, and dit_attention cudnn: pass --first-chunk-frames
# 48 48 72 96 --chunk-frames 144 --sdpa cudnn.)
CONFIG = dict(cuda_graphs=True, tf32=True, dit_dtype="bfloat16", compile="blocks", compile_vocoder="activations",
              polyphase_upsampling=True, warmup_graphs=True, max_graph_batch=16)
# (tf32 sets process-wide flags: the modes after graphs_tf32 keep them, as a config with tf32 would.)
MODES = {"eager": dict(cuda_graphs=False), "graphs": dict(cuda_graphs=True), "graphs_tf32": dict(cuda_graphs=True, tf32=True),
         "graphs_bf16": dict(cuda_graphs=True, tf32=True, dit_dtype="bfloat16"),
         "graphs_fp16": dict(cuda_graphs=True, tf32=True, dit_dtype="float16"),
         # the configs' settings, with the vocoder's upsamplers as forward convolutions
         "graphs_bf16_poly": dict(cuda_graphs=True, tf32=True, dit_dtype="bfloat16", polyphase_upsampling=True),
         # ... and with the DiT's layers and the vocoder through torch.compile
         "graphs_bf16_compiled": dict(cuda_graphs=True, tf32=True, dit_dtype="bfloat16", compile=True,
                                      warmup_graphs=True),
         "graphs_bf16_poly_compiled": dict(cuda_graphs=True, tf32=True, dit_dtype="bfloat16",
                                           polyphase_upsampling=True, compile=True, warmup_graphs=True),
         # ... the DiT compiled block by block (its layers share their blocks' code: a shorter compile)
         "graphs_bf16_compiled_blocks": dict(cuda_graphs=True, tf32=True, dit_dtype="bfloat16", compile="blocks",
                                             warmup_graphs=True),
         "graphs_bf16_poly_compiled_blocks": dict(cuda_graphs=True, tf32=True, dit_dtype="bfloat16",
                                                  polyphase_upsampling=True, compile="blocks", warmup_graphs=True),
         # ... the DiT only (block by block), the vocoder's graphs of the plain modules: the shortest compile
         "graphs_bf16_compiled_dit_blocks": dict(cuda_graphs=True, tf32=True, dit_dtype="bfloat16", compile="blocks",
                                                 compile_vocoder=False, warmup_graphs=True),
         # ... with polyphase upsampling: the 7B configs' token2wav settings before 2026-12-02's thirteenth run
         "config_dit_only": CONFIG | dict(compile_vocoder=False),
         # ... with the vocoder's anti-aliased activations compiled (one fused expression for all): the 7B configs'
         "config": CONFIG,
         # ... with one DiT graph per solver step, replayed per step (`dit_graph: step`: shorter captures)
         "config_step_graphs": CONFIG | dict(dit_graph="step"),
         # ... with one projection GEMM for the attention's queries, keys and values (`dit_fused_qkv`)
         "config_fused_qkv": CONFIG | dict(dit_graph="step", dit_fused_qkv=True),
         # ... with each stream's look-back keys and values kept between windows (`dit_past_cache`:
         # no past frames solved again): the 7B configs' token2wav since 2026-12-04
         "config_past_cache": CONFIG | dict(dit_graph="step", dit_fused_qkv=True, dit_past_cache=True),
         # ... with the vocoder's activations as hand-written Triton kernels (`compile_vocoder: triton`)
         "config_triton_vocoder": CONFIG | dict(dit_graph="step", dit_fused_qkv=True, dit_past_cache=True,
                                                compile_vocoder="triton"),
         # ... with the DiT feed-forward's GELU in its first GEMM's epilogue (`dit_gelu_epilogue`)
         "config_gelu_epilogue": CONFIG | dict(dit_graph="step", dit_fused_qkv=True, dit_past_cache=True,
                                               dit_gelu_epilogue=True),
         # ... both
         "config_triton_gelu": CONFIG | dict(dit_graph="step", dit_fused_qkv=True, dit_past_cache=True,
                                             compile_vocoder="triton", dit_gelu_epilogue=True)}


def decode(t2w: Token2Wav, codes: list[torch.Tensor]) -> tuple[list[float], float]:
    """Step times (s) and total wall (s) to stream-decode every code sequence together."""
    streams = [t2w.open_stream(None, seed=i) for i in range(len(codes))]
    for st, c in zip(streams, codes):
        st.feed(c, final=True)
    steps, t0 = [], time.perf_counter()
    while not all(st.done for st in streams):
        t = time.perf_counter()
        t2w.stream_step([st for st in streams if not st.done])
        if t2w.device.type == "cuda":
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
    return steps, time.perf_counter() - t0


def split(t2w: Token2Wav, codes: list[torch.Tensor]) -> dict:
    """Seconds of one decode in the DiT solves and in the vocoder, each call synchronised (a
    wrapper on this instance's two methods: the benchmark's own, the class is untouched)."""
    spent = {"dit_s": 0.0, "vocoder_s": 0.0}

    def timed(key, fn):
        def run(*args, **kwargs):
            torch.cuda.synchronize() if t2w.device.type == "cuda" else None
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize() if t2w.device.type == "cuda" else None
            spent[key] += time.perf_counter() - t
            return out
        return run

    t2w._sample_mels, t2w._vocode = timed("dit_s", t2w._sample_mels), timed("vocoder_s", t2w._vocode)
    try:
        _, wall = decode(t2w, codes)
    finally:
        del t2w._sample_mels, t2w._vocode  # back to the class's methods
    return {k: round(v, 3) for k, v in spent.items()} | {"split_wall_s": round(wall, 3)}


def profile(t2w: Token2Wav, codes: list[torch.Tensor], out: Path) -> None:
    """One decode under the torch profiler: the top kernels and operators by device time (kernels
    inside CUDA graph replays included) in `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if t2w.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decode(t2w, codes)
    sort = "self_cuda_time_total" if t2w.device.type == "cuda" else "self_cpu_time_total"
    out.write_text(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90))
    print(f"profile written: {out}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint dir with a token2wav (e.g. the 7B shape one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--codes", type=int, default=500, help="codes per stream (500 = 10 s of audio)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--chunk-frames", type=int, default=WINDOWS["chunk_frames"],
                        help="new mel frames per window after the first ones")
    parser.add_argument("--first-chunk-frames", type=int, nargs="+", default=[WINDOWS["first_chunk_frames"]],
                        help="the first windows' new frames, in order")
    parser.add_argument("--split", action="store_true",
                        help="also time the DiT solves and the vocoder apart (one more decode, synchronised)")
    parser.add_argument("--profile", metavar="DIR",
                        help="torch-profiler table of one more decode per mode and batch, in DIR")
    parser.add_argument("--sdpa", metavar="BACKEND", choices=sorted(BACKENDS),
                        help="the DiT's attention kernel (token2wav's dit_attention); the mode's name gets "
                             "_BACKEND_attention as a suffix")
    args = parser.parse_args()
    windows = dict(WINDOWS, chunk_frames=args.chunk_frames, first_chunk_frames=args.first_chunk_frames)

    gen = torch.Generator().manual_seed(0)
    for mode in args.modes:
        # TF32 is process-wide once on: keep it last (the default order).
        t0 = time.perf_counter()
        t2w = Token2Wav(args.model, args.device, **windows, **MODES[mode], dit_attention=args.sdpa)
        name = f"{mode}_{args.sdpa}_attention" if args.sdpa else mode
        start_s = round(time.perf_counter() - t0, 1)  # (with warmup_graphs: the captures and compiles)
        for b in args.batch:
            codes = [torch.randint(0, 8192, (args.codes,), generator=gen) for _ in range(b)]
            decode(t2w, codes)  # warm-up (captures this batch's graphs)
            steps, wall = decode(t2w, codes)
            audio_s = args.codes * t2w.dit.repeats * t2w.hop / t2w.sample_rate
            print("RESULT " + json.dumps({
                "mode": name, "batch": b, "device": args.device, "step_ms_p50": round(statistics.median(steps) * 1e3, 1),
                "steps": len(steps), "step_ms": [round(t * 1e3, 1) for t in steps],
                "audio_s_per_stream": round(audio_s, 2), "rtf": round(wall / audio_s, 4),
                "audio_s_per_wall_s": round(b * audio_s / wall, 2),
                "graphs": len(t2w.graphs.graphs) if t2w.graphs is not None else 0,
                "vocoder_graphs": len(t2w.vocoder_graphs.graphs) if t2w.vocoder_graphs is not None else 0,
                "start_s": start_s, "windows": [*args.first_chunk_frames, args.chunk_frames],
                **(split(t2w, codes) if args.split else {})}), flush=True)
        if args.profile:
            profile(t2w, codes, Path(args.profile) / f"token2wav_{name}_b{len(codes)}.txt")


if __name__ == "__main__":
    main()
