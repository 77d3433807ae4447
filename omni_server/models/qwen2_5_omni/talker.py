"""The Qwen2.5-Omni talker as a vLLM model: thinker states in, codec tokens out.

The talker is a Qwen2-style decoder whose attention width is `heads * head_dim` (not the hidden size,
which vLLM's Qwen2 attention assumes), fed through `thinker_to_talker_proj`. Every input row is
`proj(thinker-space vector + codec embedding)`. Because the projection is affine, the stage splits
it: the input processor projects the thinker part of each row once per request (prompt rows become
vLLM prompt embeddings, reply rows become per-step embeddings the runner adds), and this model's
`embed_input_ids` returns `proj(codec_embed(id))` for sampled codec ids.

Positions are multimodal RoPE (3 sections), as in the reference: the talker's prompt mirrors the
thinker's, so its positions are the thinker's prompt positions (3-D over an image's grid) followed
by text positions; the thinker stage sends them with its hidden states (`StageInput.positions`, read
by the runner). A request without them gets 1-D positions, which is what text and audio prompts have.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.qwen2 import Qwen2MLP, Qwen2Model
from vllm.model_executor.models.utils import PPMissingLayer
from vllm.sequence import IntermediateTensors

from omni_server.models.masking import suppress

from .codec import banned_ids

# Checkpoint prefix of the talker inside a full Qwen2.5-Omni checkpoint.
PREFIX = "talker."


class TalkerAttention(nn.Module):
    def __init__(self, config, cache_config: CacheConfig | None, quant_config: QuantizationConfig | None,
                 prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=True, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=False, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=dict(config.rope_parameters))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class TalkerDecoderLayer(nn.Module):
    def __init__(self, config, cache_config: CacheConfig | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.self_attn = TalkerAttention(config, cache_config, quant_config, f"{prefix}.self_attn")
        self.mlp = Qwen2MLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            hidden_act=config.hidden_act, quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen2_5OmniTalker(nn.Module, SupportsMRoPE):
    """vLLM model for `model_class: qwen2_5_omni.talker` (hf_config = the checkpoint's talker_config)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.config = config
        # The decoder stack (compiled, CUDA-graph friendly); its own token embedding is unused:
        # inputs always arrive as embeddings (prompt embeds + embed_input_ids below).
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=f"{prefix}model",
                                decoder_layer_type=TalkerDecoderLayer)
        self.model.embed_tokens = PPMissingLayer()
        self.codec_embed = VocabParallelEmbedding(config.vocab_size, config.embedding_size,
                                                  prefix=f"{prefix}codec_embed")
        self.thinker_to_talker_proj = ReplicatedLinear(config.embedding_size, config.hidden_size, bias=True,
                                                       prefix=f"{prefix}thinker_to_talker_proj")
        self.codec_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                         prefix=f"{prefix}codec_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.register_buffer("banned_ids", banned_ids(vllm_config.model_config.model, config), persistent=False)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.codec_rows: torch.Tensor | None = None  # [vocab, hidden] (embed_input_ids), once weights are in

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.codec_rows is None and get_tensor_model_parallel_world_size() == 1 \
                and not (input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            # proj(codec_embed(id)) of every id, once: each decode step then looks its row up
            # instead of running the embedding and a matmul outside the CUDA graph (the talker's
            # step is host-bound at low batch).
            with torch.no_grad():
                self.codec_rows = self.thinker_to_talker_proj(self.codec_embed.weight)[0]
        if self.codec_rows is not None:
            return nn.functional.embedding(input_ids, self.codec_rows)
        out, _ = self.thinker_to_talker_proj(self.codec_embed(input_ids))
        return out

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.model(None, positions, intermediate_tensors, inputs_embeds)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features) -> tuple[torch.Tensor, int]:
        """Positions of a request that brought none (see the module docstring): 1-D."""
        return torch.arange(len(input_tokens)).expand(3, -1).clone(), 0

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return suppress(self.logits_processor(self.codec_head, hidden_states), self.banned_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Take the talker's tensors out of a full checkpoint (thinker/token2wav ones are skipped)."""
        self.codec_rows = None  # (from the new weights on the next call)
        own = dict(self.named_parameters())
        renames = {"model.embed_tokens.weight": "codec_embed.weight"}
        loaded: set[str] = set()

        def decoder_weights():
            for name, tensor in weights:
                if not name.startswith(PREFIX):
                    continue
                name = renames.get(name[len(PREFIX):], name[len(PREFIX):])
                if name.startswith("model."):
                    yield name[len("model."):], tensor
                elif name in own:
                    param = own[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                    loaded.add(name)

        loaded |= {f"model.{n}" for n in self.model.load_weights(decoder_weights())}
        return loaded
