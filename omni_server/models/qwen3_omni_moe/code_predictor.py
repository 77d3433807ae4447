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

from omni_server.models.checkpoint import load_module, read_config

WEIGHTS_PREFIX = "talker.code_predictor."
# transformers' settings when the talker samples (greedy talker: greedy predictor).
SAMPLE_TOP_K, SAMPLE_TOP_P = 50, 0.8


class CodePredictor:
    def __init__(self, model_dir: str, device: torch.device | str, dtype: torch.dtype = torch.float32):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration as Module,
        )

        config = read_config(model_dir).talker_config.code_predictor_config
        self.device = torch.device(device)
        self.groups = config.num_code_groups - 1
        self.module = load_module(Module, config, model_dir, WEIGHTS_PREFIX, self.device).to(dtype)
        self.dtype = dtype
        # Group j's positions (2 rows at j = 0, then one each) are slices of one range.
        self._positions = torch.arange(self.groups + 2, device=self.device)

    @torch.inference_mode()
    def __call__(self, h: torch.Tensor, e0: torch.Tensor, generators: list[torch.Generator | None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """h, e0: [B, hidden]. Returns (codes [B, 15] int64: c1..c15, residual [B, hidden]).
        `generators`: per row, None = greedy, else sample (top-k 50, top-p 0.8) from that generator."""
        from transformers import DynamicCache

        model, embeds = self.module.model, self.module.model.get_input_embeddings()
        batch = h.shape[0]
        x = torch.stack([h, e0], dim=1).to(self.device, self.dtype)
        cache = DynamicCache()
        codes, residual = [], torch.zeros(batch, h.shape[-1], device=self.device, dtype=self.dtype)
        for j in range(self.groups):
            start = 0 if j == 0 else j + 1
            pos = self._positions[start:start + x.shape[1]].expand(batch, -1)
            out = model(inputs_embeds=x, position_ids=pos, past_key_values=cache, use_cache=True)
            logits = self.module.lm_head[j](out.last_hidden_state[:, -1]).float()
            code = _pick(logits, generators)
            codes.append(code)
            x = embeds[j](code)[:, None]
            residual += x[:, 0]
        return torch.stack(codes, dim=1), residual


def _pick(logits: torch.Tensor, generators: list[torch.Generator | None] | None) -> torch.Tensor:
    out = logits.argmax(dim=-1)
    for i, g in enumerate(generators or []):
        if g is None:
            continue
        row = logits[i]
        top = torch.topk(row, min(SAMPLE_TOP_K, row.numel()))
        probs = torch.softmax(top.values, dim=-1)
        keep = torch.cumsum(probs, dim=-1) - probs < SAMPLE_TOP_P  # smallest prefix reaching top_p
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        out[i] = top.indices[torch.multinomial(probs / probs.sum(), 1, generator=g)[0]]
    return out
