"""The Qwen3-Omni talker's code predictor: for each talker step, the 15 residual codes of the frame
whose first code (c0) the talker just sampled (docs/qwen3_omni.md, section 2).

A small dense decoder (transformers' own module, weights `talker.code_predictor.*`) runs a fresh
16-position sequence per frame: prefill [h, E0(c0)], where h is the talker's final normed hidden
state at the position that produced c0 and E0 the talker's codec embedding, gives c1 through
lm_head[0]; then c_j fed through codec_embedding[j-1] gives c_{j+1} through lm_head[j]. Every frame
of a batch has the same length, so a batch runs as one dense sequence batch with no padding.
The talker's next input adds E0(c0) + sum_j codec_embedding[j-1](c_j) (j = 1..15): `residual` here
is that sum without E0(c0), which the talker's own embedding provides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_server.models.checkpoint import cast_keeping_rotary, load_module, read_config
from omni_server.models.graphs import ShapeGraphs, pow2

WEIGHTS_PREFIX = "talker.code_predictor."
# transformers' settings when the talker samples (greedy talker: greedy predictor).
SAMPLE_TOP_K, SAMPLE_TOP_P = 50, 0.8


class _FrameCache:
    """The KV cache of one frame's 16 positions, written in place (the decoder layers call `update`):
    every step of a frame has fixed shapes, so a whole frame can be one CUDA graph."""

    def __init__(self, layers: int, batch: int, kv_heads: int, length: int, head_dim: int, like: torch.Tensor):
        self.k = like.new_zeros(layers, batch, kv_heads, length, head_dim)
        self.v = torch.zeros_like(self.k)
        self.end = 0  # positions the step being run fills up to

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int):
        lo = self.end - key.shape[2]
        self.k[layer, :, :, lo:self.end] = key
        self.v[layer, :, :, lo:self.end] = value
        return self.k[layer, :, :, :self.end], self.v[layer, :, :, :self.end]


class CodePredictor:
    def __init__(self, model_dir: str, device: torch.device | str, dtype: torch.dtype = torch.float32,
                 cuda_graphs: bool = True, max_graph_batch: int = 64, compile: bool = False):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration as Module,
        )

        config = read_config(model_dir).talker_config.code_predictor_config
        self.device = torch.device(device)
        self.groups = config.num_code_groups - 1
        self.module = cast_keeping_rotary(load_module(Module, config, model_dir, WEIGHTS_PREFIX, self.device), dtype)
        self.dtype = dtype
        # Group j's positions (2 rows at j = 0, then one each) are slices of one range.
        self._positions = torch.arange(self.groups + 2, device=self.device)
        # On CUDA a frame is thousands of small kernels: one graph per batch size (rounded up to a power
        # of two) replays them at once.
        # compile: each decoder layer's two halves around its KV-cache write and attention (norms,
        # projections, rotary; output projection, MLP) through torch.compile, which fuses their
        # element-wise kernels (H200, 30B-A3B shapes, 2026-12-01: a c=1 talker step spent 15 ms on
        # the GPU in ~4,800 kernels, most of them the code predictor's small ones). One compiled
        # copy of each half serves every layer and step (the layer is an argument; shapes are
        # dynamic): batch 1 or more, query length 1 or 2, compiled while `warm_up` captures the
        # graphs, and never after. (The whole unrolled frame compiled as one graph of ~3,200 ops
        # did not finish starting within 600 s on the H200, 2026-12-01.)
        self.max_graph_batch = max_graph_batch
        attention = self.module.model.layers[0].self_attn
        if compile and getattr(attention, "sliding_window", None) is not None:
            raise ValueError("code predictor compile: sliding-window attention is not supported")
        self._halves = ((torch.compile(_attention_inputs, dynamic=True), torch.compile(_layer_output, dynamic=True))
                        if compile else None)
        self.graphs = (ShapeGraphs(self._frame, max_graphs=max_graph_batch.bit_length() + 1, name="code predictor",
                                   warm_each=True)
                       if cuda_graphs and self.device.type == "cuda" else None)

    @torch.inference_mode()
    def __call__(self, h: torch.Tensor, e0: torch.Tensor, generators: list[torch.Generator | None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """h, e0: [B, hidden]. Returns (codes [B, 15] int64: c1..c15, residual [B, hidden] float32:
        summed unrounded, so that E0(c0) + residual rounds once, as transformers' one sum does).
        `generators`: per row, None = greedy, else sample (top-k 50, top-p 0.8) from that generator."""
        batch = h.shape[0]
        x = torch.stack([h, e0], dim=1).to(self.device, self.dtype)
        # Each sampling row draws its frame's 15 uniforms from its own generator up front; the
        # frame itself then samples without host work (inverse CDF of the filtered distribution).
        # Greedy rows get -1 (no host -> device copy of a flag, which would wait for the stream).
        # (float32 whatever the default dtype: vLLM builds models under its model dtype.)
        u = torch.full((batch, self.groups), -1.0, device=self.device, dtype=torch.float32)
        for i, g in enumerate(generators or []):
            if g is not None:
                u[i] = torch.rand(self.groups, generator=g, device=g.device, dtype=torch.float32).to(self.device)
        rows = pow2(batch)
        if self.graphs is None or rows > self.max_graph_batch:
            return self._frame(x, u)
        if rows > batch:  # (padding rows decode garbage nobody reads)
            pad = rows - batch
            x, u = torch.cat([x, x[:1].expand(pad, -1, -1)]), torch.cat([u, u[:1].expand(pad, -1)])
        codes, residual = self.graphs.run((rows,), (x, u))
        return codes[:batch], residual[:batch]

    def warm_up(self, max_batch: int) -> None:
        """Capture the graphs of every batch size up to `max_batch` now, not on the first requests."""
        if self.graphs is None:
            return
        rows, hidden = 1, self.module.config.hidden_size
        while rows <= min(max_batch, self.max_graph_batch):
            x = torch.zeros(rows, hidden, device=self.device, dtype=self.dtype)
            self(x, x)
            rows *= 2

    def _frame(self, x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame for every row: the 2-position prefill [h, E0(c0)], then one position per
        code; what transformers' model forward does per call, with the KV cache in place."""
        model, embeds = self.module.model, self.module.model.get_input_embeddings()
        cfg = model.config
        batch = x.shape[0]
        cache = _FrameCache(len(model.layers), batch, cfg.num_key_value_heads, self.groups + 1,
                            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, x)
        codes, residual = [], torch.zeros(batch, x.shape[-1], device=x.device, dtype=torch.float32)
        for j in range(self.groups):
            start = 0 if j == 0 else j + 1
            cache.end = start + x.shape[1]
            pos = self._positions[start:cache.end].expand(batch, -1)
            position_embeddings = model.rotary_emb(x, pos)
            hidden = x
            for i, layer in enumerate(model.layers):  # (no mask: causal over the prefill, all of the prefix after)
                if self._halves is None:
                    hidden = layer(hidden, attention_mask=None, position_ids=pos, past_key_values=cache,
                                   use_cache=True, position_embeddings=position_embeddings)
                    continue
                before, after = self._halves
                q, k, v = before(layer, hidden, *position_embeddings)
                k, v = cache.update(k, v, i)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                                     scale=layer.self_attn.scaling, enable_gqa=True)
                hidden = after(layer, hidden, out)
            logits = self.module.lm_head[j](model.norm(hidden[:, -1])).float()
            code = _pick(logits, u[:, j])
            codes.append(code)
            x = embeds[j](code)[:, None]
            residual += x[:, 0].float()
        return torch.stack(codes, dim=1), residual


def _attention_inputs(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer up to its attention: q, k, v [B, heads, L, head_dim] as transformers'
    layer computes them (input norm, projections, per-head q / k norms, rotary)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, attn.v_proj(x).view(shape).transpose(1, 2)


def _layer_output(layer: torch.nn.Module, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of the layer: output projection and residual, post-attention norm, MLP, residual."""
    hidden = hidden + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(*hidden.shape[:-1], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _pick(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row: argmax where `u` < 0, else the code whose cumulative probability first exceeds
    `u` (in [0, 1)) in the top-k / top-p filtered distribution: a draw from it when `u` is uniform
    (transformers' sampling filters)."""
    greedy = logits.argmax(dim=-1)
    top = torch.topk(logits, min(SAMPLE_TOP_K, logits.shape[-1]), dim=-1)
    probs = torch.softmax(top.values, dim=-1)
    keep = torch.cumsum(probs, dim=-1) - probs < SAMPLE_TOP_P  # smallest prefix reaching top_p
    cdf = torch.cumsum(probs * keep, dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)
    return torch.where(u >= 0, top.indices.gather(1, pick)[:, 0], greedy)
