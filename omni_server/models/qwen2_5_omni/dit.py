"""The Qwen2.5-Omni DiT's layers, run with attention masks made once per ODE solve.

transformers' `DiTDecoderLayer` turns the block-difference matrix into its boolean attention mask on
every call: 22 layers x 4 evaluations x 8 solver steps a window. Under torch.compile with dynamic
shapes that became a kernel per call, padding a float copy of the mask to the attention kernel's
alignment (151 of 2,520 ms of GPU time in a batch-16 token2wav step on the H200, BENCHMARKS.md
eleventh run). The layers differ only in how many blocks they see behind and ahead (three kinds in
the 7B), so `block_masks` makes each kind's additive mask once, its rows padded to that alignment,
and `run_layer` restates the layer's forward with the mask passed in: the same modules and the
same operations in the same order.

A streaming decode may also keep, per stream, the keys and values its layers that look back saw in
the last settled frames (`run_layer_with_past`): the next window then starts at its first new frame
instead of recomputing past frames only to attend to them (token2wav's `dit_past_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Rows of an additive mask start at multiples of this many elements (PyTorch's SDPA kernels want an
# aligned attention bias, and copy one that is not).
_ALIGN = 8

# `dit_attention` values: the attention kernel the DiT must use (null: PyTorch's choice).
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def backend_error(backend: SDPBackend, heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> str | None:
    """Why `backend` cannot run the DiT's attention here (None: it can): one small call shaped like
    the DiT's (an additive mask over 24 aligned frames), since each kernel takes only some GPUs,
    dtypes and head sizes."""
    q = torch.zeros(2, heads, 24, head_dim, dtype=dtype, device=device)
    mask = torch.zeros(2, 1, 24, 24, dtype=dtype, device=device)
    try:
        with torch.inference_mode(), sdpa_kernel([backend]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    except RuntimeError as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def windows(dit: torch.nn.Module) -> list[tuple[int, int]]:
    """Each layer's (blocks behind, blocks ahead) it attends to."""
    return [(int(layer.look_backward_block), int(layer.look_ahead_block)) for layer in dit.transformer_blocks]


def block_masks(block_diff: torch.Tensor, kinds: Sequence[tuple[int, int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """One additive mask (0 where a frame attends, -inf elsewhere) per (behind, ahead) kind, from
    `block_diff` ([rows, 1, F, K]: key block - query block, K keys). Each is a [rows, 1, F, K] view
    whose rows start at aligned offsets."""
    rows, _, frames, keys = block_diff.shape
    padded = -(-keys // _ALIGN) * _ALIGN
    masks = []
    for behind, ahead in kinds:
        out = torch.empty(rows, 1, frames, padded, dtype=dtype, device=block_diff.device)
        seen = (block_diff >= -float(behind)) & (block_diff <= float(ahead))
        out[..., :keys] = torch.zeros((), dtype=dtype, device=block_diff.device).masked_fill(~seen, float("-inf"))
        masks.append(out[..., :keys])
    return masks


def fuse_qkv(dit: torch.nn.Module) -> None:
    """Give each layer's attention one projection for its queries, keys and values (`qkv`: to_q,
    to_k and to_v's weights stacked), used by `run_layer`: one GEMM three times as wide instead of
    three (the DiT is launch-bound at batch 1: ~13 kernels a layer, 36 evaluations a window). The
    same dot products; only the GEMM kernel's summation order may differ."""
    for layer in dit.transformer_blocks:
        attn = layer.attn
        parts = (attn.to_q, attn.to_k, attn.to_v)
        biased = {p.bias is not None for p in parts}
        if len(biased) > 1:
            raise ValueError("fuse_qkv: the q, k and v projections differ in having a bias")
        qkv = torch.nn.Linear(attn.to_q.in_features, sum(p.out_features for p in parts), bias=biased.pop(),
                              device=attn.to_q.weight.device, dtype=attn.to_q.weight.dtype)
        with torch.no_grad():
            qkv.weight.copy_(torch.cat([p.weight for p in parts]))
            if qkv.bias is not None:
                qkv.bias.copy_(torch.cat([p.bias for p in parts]))
        qkv.requires_grad_(False)
        # The three keep their parameters as views of the stacked ones (no second copy in memory).
        start = 0
        for p in parts:
            rows = slice(start, start + p.out_features)
            p.weight = torch.nn.Parameter(qkv.weight[rows], requires_grad=False)
            if p.bias is not None:
                p.bias = torch.nn.Parameter(qkv.bias[rows], requires_grad=False)
            start += p.out_features
        attn.qkv = qkv


class GeluEpilogueMLP(torch.nn.Module):
    """transformers' `DiTMLP` (Linear, tanh-GELU, Dropout, Linear) with its first Linear and the
    GELU as one `torch._addmm_activation` call: on a CUDA device cuBLASLt's GEMM with a bias and
    tanh-GELU epilogue, so the GELU is no separate pass over the 2x-wide activations (68 of
    1,666 ms of token2wav's GPU time at batch 16, H200, BENCHMARKS.md twenty-third run). torch.compile
    keeps the call as one extern kernel (Inductor does not decompose it). CUDA only: the CPU kernel
    applies the exact GELU, not the tanh form the checkpoint uses."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        up, act, _, down = mlp.ff
        if not isinstance(act, torch.nn.GELU) or act.approximate != "tanh" or up.bias is None:
            raise ValueError("fuse_gelu: expected the DiT's Linear(bias) -> GELU(tanh) -> Dropout -> Linear")
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (Dropout is the identity at inference.)
        h = torch._addmm_activation(self.up.bias, x.reshape(-1, x.shape[-1]), self.up.weight.t(), use_gelu=True)
        return self.down(h.view(*x.shape[:-1], h.shape[-1]))


def fuse_gelu(dit: torch.nn.Module) -> None:
    """Run each layer's feed-forward as `GeluEpilogueMLP` (the same parameters, not copied)."""
    for layer in dit.transformer_blocks:
        layer.ff = GeluEpilogueMLP(layer.ff)


def run_layer(layer: torch.nn.Module, h: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              mask: torch.Tensor, backend: SDPBackend | None = None) -> torch.Tensor:
    """`DiTDecoderLayer.forward` with its attention mask given (`block_masks`)."""
    norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = layer.attn_norm(h, emb=temb)
    h = h + gate_msa.unsqueeze(1) * _attention(layer.attn, norm, cos, sin, mask, backend)
    norm = layer.ff_norm(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    return h + gate_mlp.unsqueeze(1) * layer.ff(norm)


def run_layer_with_past(layer: torch.nn.Module, h: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, mask: torch.Tensor, backend: SDPBackend | None, past: torch.Tensor,
                        keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`run_layer` for a layer that looks back, whose keys and values also hold P past frames before
    the window's F (`past`: [2, rows, heads, P, head_dim], keys then values, rotated at their
    positions; `mask`: [rows, 1, F, P + F]). Returns the layer's output and the keys and values of
    the P frames at `keep` ([rows, 1, P, 1] indices into past + window: the last settled ones), the
    next window's `past`."""
    norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = layer.attn_norm(h, emb=temb)
    out, kept = _attention(layer.attn, norm, cos, sin, mask, backend, past, keep)
    h = h + gate_msa.unsqueeze(1) * out
    norm = layer.ff_norm(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    return h + gate_mlp.unsqueeze(1) * layer.ff(norm), kept


def _attention(attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
               backend: SDPBackend | None, past: torch.Tensor | None = None, keep: torch.Tensor | None = None):
    """`DiTAttention.forward` (transformers' sdpa path) with an additive mask; with `past`, also
    the kept keys and values (`run_layer_with_past`)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import apply_rotary_pos_emb, deinterleave_head_dim

    rows, heads = x.shape[0], attn.heads
    if hasattr(attn, "qkv"):  # (fuse_qkv)
        qkv = attn.qkv(x).view(rows, -1, 3, heads, attn.inner_dim // heads)
        query, key, value = (t.transpose(1, 2) for t in qkv.unbind(2))
        # (As below, but new tensors, not writes into views of one buffer: Inductor made a slow
        # kernel of those, 20x the layer's time on the CPU.)
        q1, k1 = apply_rotary_pos_emb(deinterleave_head_dim(query[:, :1]), deinterleave_head_dim(key[:, :1]), cos, sin)
        query, key = torch.cat([q1, query[:, 1:]], dim=1), torch.cat([k1, key[:, 1:]], dim=1)
    else:
        query, key, value = (proj(x).view(rows, -1, heads, attn.inner_dim // heads).transpose(1, 2)
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        # The checkpoint was trained with RoPE on the first head only, in the interleaved layout.
        query[:, :1], key[:, :1] = apply_rotary_pos_emb(deinterleave_head_dim(query[:, :1]),
                                                        deinterleave_head_dim(key[:, :1]), cos, sin)
    kept = None
    if past is not None:
        key, value = torch.cat([past[0], key], dim=2), torch.cat([past[1], value], dim=2)
        index = keep.expand(-1, key.shape[1], -1, key.shape[3])
        kept = torch.stack([key.gather(2, index), value.gather(2, index)])
    if backend is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    else:
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    out = out.transpose(1, 2).reshape(rows, -1, attn.inner_dim).to(query.dtype)
    out = attn.to_out[1](attn.to_out[0](out))
    return out if past is None else (out, kept)
