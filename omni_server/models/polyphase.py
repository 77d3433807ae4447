"""A BigVGAN anti-alias 2x upsampler as a plain depthwise convolution (same output to rounding).

BigVGAN's `UpSample1d` (transformers' `Qwen2_5OmniUpSample1d`) pads the signal by replication,
runs a depthwise transposed convolution with a 12-tap windowed-sinc filter at stride 2, scales by
2 and crops. On the H200 cuDNN runs that transposed convolution as a grouped "dgrad" kernel (470 us
per call at c=16, 9% of token2wav's GPU time, BENCHMARKS.md fifth run). The same output is two
interleaved 6-tap filters (the even and the odd taps) over the padded input: one depthwise forward
convolution with two output channels per input channel, then an interleave.

Derivation (filter f of K taps, stride 2, pad p = K/2 - 1, crop c = 2p + (K - 2)/2 on both sides):
the transposed convolution gives y[m] = sum_n xp[n] f[m - 2n]; output o = m - c. For K = 12 (p = 5,
c = 15): y[2q] = sum_t xp[q+2+t] f[11-2t] and y[2q+1] = sum_t xp[q+3+t] f[10-2t], t = 0..5, i.e.
two 7-tap correlations over xp[q+2 .. q+8] (the odd phase shifted by one tap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PolyphaseUpsample2x(nn.Module):
    """Drop-in for an `UpSample1d` module with ratio 2 and an even kernel size ([B, C, L] -> [B, C, 2L])."""

    def __init__(self, upsample: nn.Module, channels: int):
        """`channels`: the channel count of its input (its filters are made here, per channel)."""
        super().__init__()
        ratio, taps, crop = int(upsample.ratio), int(upsample.kernel_size), int(upsample.pad_left)
        # (transformers' layout: K = 12, crop 15; an even crop would need no tap shift, not handled)
        if ratio != 2 or taps % 2 or crop % 2 == 0 or upsample.pad_right != crop:
            raise ValueError(f"unsupported upsampler: ratio {ratio}, {taps} taps, crop {upsample.pad_left}/"
                             f"{upsample.pad_right}")
        f = upsample.filter.reshape(-1).float() * ratio  # the module's output scale, folded in
        half = taps // 2
        # Even outputs read xp[q + offset + t] with taps f[K-1-2t]; odd ones one sample later, f[K-2-2t].
        even, odd = torch.zeros(half + 1), torch.zeros(half + 1)
        even[:half] = f.flip(0)[0::2]  # f[K-1], f[K-3], ...
        odd[1:] = f.flip(0)[1::2]  # f[K-2], f[K-4], ...
        self.pad = int(upsample.pad)
        self.offset = (crop - 1) // 2 - half + 1
        # [2, K/2 + 1]: the even and the odd outputs' taps over xp[q + offset ...].
        self.register_buffer("phases", torch.stack([even, odd]).to(upsample.filter.dtype), persistent=False)
        # [2C, 1, taps]: channel k's two phases. Made here, never in forward: under torch.compile
        # state set by a first call fails the second call's guards, which then compiles again
        # (inside a CUDA graph capture on the H200: the vocoder's graphs were lost, 2026-11-30f).
        self.register_buffer("weight", self.phases[:, None, :].repeat(channels, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, n = x.shape
        xp = F.pad(x, (self.pad, self.pad), mode="replicate")
        y = F.conv1d(xp, self.weight.to(x.dtype), groups=c)  # [B, 2C, L + 2*pad - taps + 1]
        y = y[..., self.offset:self.offset + n]
        return y.reshape(b, c, 2, n).transpose(2, 3).reshape(b, c, 2 * n)


def use_polyphase_upsampling(model: nn.Module) -> int:
    """Replace every anti-aliased activation's 2x upsampler in `model` whose channel count its
    activation gives (BigVGAN's Snake: `in_features`) by PolyphaseUpsample2x; returns how many were
    replaced."""
    count = 0
    for module in list(model.modules()):
        up = getattr(module, "upsample", None)
        if up is not None and hasattr(up, "filter") and getattr(up, "ratio", None) == 2:
            channels = getattr(getattr(module, "act", None), "in_features", None)
            if channels is None:
                continue
            module.upsample = PolyphaseUpsample2x(up, int(channels)).to(up.filter.device)
            count += 1
    return count
