"""BigVGAN's anti-aliased SnakeBeta activation (2x upsample, SnakeBeta, 2x downsample) as one
expression of shifted slices of the upsampled signal's two phases, for torch.compile to fuse (on
the H200 Inductor made three kernels of it: a pad, the phases, the downsampling sum;
antialias_triton.py has the same as two hand-written Triton kernels).

transformers runs each activation as a replication pad, a depthwise (transposed) convolution, five
element-wise kernels, another pad and another depthwise convolution. In the 7B vocoder at batch 16
on the H200 those took about 80 of the vocoder's 107 ms per call (BENCHMARKS.md tenth run: PyTorch's
generic depthwise kernel alone 13% of token2wav's GPU time), ten passes over tensors that a fused
kernel reads once. The filters are 6 (up, per output phase) and 12 (down) taps, so the sums below
are short; the same function, compiled once with dynamic shapes, serves every activation.

Written over the two phases of the upsampled signal, never the interleaved signal itself: with it
as a tensor (stack, flatten, stride-2 slices) Inductor made three kernels on the H200 (523 of a
batch-16 decode's 2,520 ms, BENCHMARKS.md eleventh run) and, on the CPU host, one kernel slower than
transformers' eager module (`benchmarks/antialias_speed.py --device cpu`: 212 ms against 164);
over the phases it is 6x faster than that module on the CPU (17.5 ms against 105); on the H200 its
three kernels took 355 of a batch-16 decode's 1,666 ms of GPU time (twenty-third run).

Equal to transformers' module up to float rounding (the sums' order differs from cuDNN's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_server.models.polyphase import PolyphaseUpsample2x


def antialiased_snake(up: tuple[tuple[float, ...], tuple[float, ...]], down: tuple[float, ...], up_pad: int,
                      up_offset: int, down_left: int, down_right: int):
    """The activation for one pair of filters, as `fn(x [B, C, n], alpha, inv_beta) -> [B, C, n]`;
    `alpha`, `inv_beta` [C, 1]: SnakeBeta's exp(alpha) and 1 / (exp(beta) + eps). `up`: the
    upsampler's even and odd output taps over the input replicate-padded by `up_pad`, from
    `up_offset` (PolyphaseUpsample2x's); `down`: the downsampler's taps over the activation
    replicate-padded by (`down_left`, `down_right`), at stride 2. (Filters and paddings are
    constants of a closure: as tensor or int arguments torch.compile would make their sizes
    symbols, and one equal to a dimension of `x` would pin that dimension.)"""
    even_taps, odd_taps = up
    if down_left + down_right != len(down) - 1:  # (n samples out of 2n at stride 2)
        raise ValueError(f"unsupported downsampler padding: {down_left} + {down_right} for {len(down)} taps")
    # The downsampler's term k reads the interleaved signal at 2t + k - down_left: the even phase at
    # t + a for k - down_left = 2a, the odd phase at t + a for 2a + 1. Each phase is padded by
    # `before` and `after` samples for a's range; the interleaved signal's replicate padding repeats
    # its first sample (the even phase's first) before and its last (the odd phase's last) after,
    # whichever phase a term reads.
    terms = [(w, (k - down_left) % 2, (k - down_left) // 2) for k, w in enumerate(down) if w != 0.0]
    before = max(0, -min(a for _, _, a in terms))
    after = max(0, max(a for _, _, a in terms))

    def fn(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        xp = F.pad(x, (up_pad, up_pad), mode="replicate")
        shifted = [xp[..., up_offset + j:up_offset + j + n] for j in range(len(even_taps))]
        phases = []
        for taps in (even_taps, odd_taps):
            u = sum(w * s for w, s in zip(taps, shifted) if w != 0.0)
            # SnakeBeta, in transformers' operation order: x + 1 / (b + eps) * sin(x * a) ** 2
            phases.append(u + inv_beta * torch.pow(torch.sin(u * alpha), 2))
        first, last = phases[0][..., :1], phases[1][..., -1:]
        padded = [torch.cat([first] * before + [p] + [last] * after, dim=-1) for p in phases]
        return sum(w * padded[phase][..., before + a:before + a + n] for w, phase, a in terms)

    return fn


class AntiAliasedSnake(nn.Module):
    """Drop-in for a BigVGAN anti-aliased activation (`upsample`: ratio 2 with an even kernel, or its
    PolyphaseUpsample2x; `act`: SnakeBeta; `downsample`: stride 2). `wrap`: applied to the function
    `antialiased_snake` makes (e.g. torch.compile), once per pair of filters (in `shared`): every
    activation of a vocoder shares one. `make`: what makes that function from the filters
    (`antialiased_snake`, or antialias_triton's kernels). Inference only: SnakeBeta's parameters are
    read once, here."""

    def __init__(self, activation: nn.Module, channels: int, wrap=None, shared: dict | None = None, make=None):
        super().__init__()
        up, act, down = activation.upsample, activation.act, activation.downsample
        if not isinstance(up, PolyphaseUpsample2x):
            up = PolyphaseUpsample2x(up, channels)  # (raises for what it cannot take)
        if not all(hasattr(act, k) for k in ("alpha", "beta", "no_div_by_zero")):
            raise ValueError(f"not a SnakeBeta activation: {type(act).__name__}")
        if int(down.stride) != 2:
            raise ValueError(f"unsupported downsampler: stride {down.stride}")
        filters = (tuple(tuple(p) for p in up.phases.double().tolist()), tuple(down.filter.double().reshape(-1).tolist()),
                   int(up.pad), int(up.offset), int(down.pad_left), int(down.pad_right))
        shared = {} if shared is None else shared
        if filters not in shared:
            fn = (antialiased_snake if make is None else make)(*filters)
            shared[filters] = fn if wrap is None else wrap(fn)
        self.fn = shared[filters]
        self.register_buffer("alpha", torch.exp(act.alpha.detach())[:, None], persistent=False)
        self.register_buffer("inv_beta", (1.0 / (torch.exp(act.beta.detach()) + act.no_div_by_zero))[:, None],
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.alpha.to(x.dtype), self.inv_beta.to(x.dtype))


def use_fused_activations(model: nn.Module, wrap=None, make=None) -> int:
    """Replace every anti-aliased SnakeBeta activation in `model` (a module with `upsample`, `act`
    and `downsample`, its channel count `act.in_features`) by AntiAliasedSnake, their function made
    once (per pair of filters, by `make`) and passed through `wrap`; returns how many were replaced."""
    count, shared = 0, {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            channels = getattr(getattr(child, "act", None), "in_features", None)
            if channels is None or not hasattr(child, "upsample") or not hasattr(child, "downsample"):
                continue
            setattr(parent, name, AntiAliasedSnake(child, int(channels), wrap, shared, make))  # (on alpha's device)
            count += 1
    return count
