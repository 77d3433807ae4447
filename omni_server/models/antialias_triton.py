"""BigVGAN's anti-aliased SnakeBeta (antialias.py's expression) as two hand-written Triton kernels.

On the H200 (BENCHMARKS.md twenty-third run) the torch.compile'd expression became three Inductor
kernels (a replicate pad, the upsampled phases with SnakeBeta, the downsampling sum) that took 355
of a batch-16 token2wav decode's 1,666 ms of GPU time. Their bytes (~32 per element and activation:
the pad's copy, the phases written and read back, x and the output; ~8.4G element-activations in
that decode, 109 activations) would take ~62 ms at the GPU's 4.3 TB/s: they ran ~6x slower.
Compiled with dynamic shapes, each element's row and position come from divisions by runtime
sizes. Here a grid of (row, block) programs walks each row contiguously, ~24 bytes per element:

1. `_phases`: the activated, upsampled signal, interleaved (even and odd phase samples
   alternating, as transformers' upsampler makes them), extended at both ends by the downsampler's
   replicate padding: sample q holds SnakeBeta(up(x)) at interleaved index clamp(q - down_left, 0,
   2n - 1). Each sample reads the upsampler's taps of x (clamped: x's own replicate padding).
2. `_down`: the downsampler's taps over that at stride 2.

Equal to transformers' module up to float32 rounding (the sums' order and fused multiply-adds; the
filters' zero taps are multiplied in, so only a non-finite input could tell them apart).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["n", "length", "channels"])
def _phases(x_ptr, alpha_ptr, inv_beta_ptr, even_ptr, odd_ptr, out_ptr, n, length, channels,
            UP_TAPS: tl.constexpr, UP_SHIFT: tl.constexpr, LEAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    q = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = tl.minimum(tl.maximum(q - LEAD, 0), 2 * n - 1)  # the interleaved index, replicate-extended
    i = m // 2
    odd = (m % 2) == 1
    x_row = x_ptr + row.to(tl.int64) * n
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(UP_TAPS):
        w = tl.where(odd, tl.load(odd_ptr + j), tl.load(even_ptr + j))
        u += w * tl.load(x_row + tl.minimum(tl.maximum(i + (UP_SHIFT + j), 0), n - 1))
    c = row % channels
    s = tl.sin(u * tl.load(alpha_ptr + c))
    # SnakeBeta in transformers' order: x + 1 / (b + eps) * sin(x * a) ** 2
    tl.store(out_ptr + row.to(tl.int64) * length + q, u + tl.load(inv_beta_ptr + c) * (s * s), mask=q < length)


@triton.jit(do_not_specialize=["n", "length"])
def _down(p_ptr, down_ptr, out_ptr, n, length, DOWN_TAPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = t < n
    p_row = p_ptr + row.to(tl.int64) * length
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(DOWN_TAPS):
        acc += tl.load(down_ptr + k) * tl.load(p_row + 2 * t + k, mask=mask, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * n + t, acc, mask=mask)


def triton_antialiased_snake(up: tuple[tuple[float, ...], tuple[float, ...]], down: tuple[float, ...], up_pad: int,
                             up_offset: int, down_left: int, down_right: int):
    """`antialias.antialiased_snake`'s contract (`fn(x [B, C, n] float32, alpha, inv_beta [C, 1]) ->
    [B, C, n]`, the same filter arguments) on the two kernels above."""
    even, odd = up
    if down_left + down_right != len(down) - 1:  # (n samples out of 2n at stride 2)
        raise ValueError(f"unsupported downsampler padding: {down_left} + {down_right} for {len(down)} taps")
    if len(even) != len(odd):
        raise ValueError(f"the upsampler's phases differ in length: {len(even)} and {len(odd)}")
    taps: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # the filters on each device, made on first use

    def fn(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"the Triton activation computes in float32, got {x.dtype}")
        b, c, n = x.shape
        if x.device not in taps:
            # (A copy to the device: not allowed inside a CUDA graph capture, hence made at the
            # first call, which the eager run before every vocoder capture is.)
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the Triton activation's first call is inside a CUDA graph capture")
            taps[x.device] = tuple(torch.tensor(v, dtype=torch.float32, device=x.device) for v in (even, odd, down))
        even_t, odd_t, down_t = taps[x.device]
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if x.numel() == 0:
            return out
        # The activated signal with the downsampler's padding: output t reads samples 2t .. 2t +
        # len(down) - 1, the last output up to 2n + len(down) - 3 (one sample to spare).
        x, rows, length = x.contiguous(), b * c, 2 * n + len(down) - 1
        phases = torch.empty(rows, length, dtype=torch.float32, device=x.device)
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # (Triton launches on the current one)
            _phases[(rows, triton.cdiv(length, BLOCK))](
                x, alpha.reshape(-1).contiguous(), inv_beta.reshape(-1).contiguous(), even_t, odd_t, phases, n, length,
                c, UP_TAPS=len(even), UP_SHIFT=up_offset - up_pad, LEAD=down_left, BLOCK=BLOCK)
            _down[(rows, triton.cdiv(n, BLOCK))](phases, down_t, out, n, length, DOWN_TAPS=len(down), BLOCK=BLOCK)
        return out

    return fn
