"""The Qwen3-Omni-MoE talker's decoder as a vLLM model: talker-space rows in, codebook-0 codes out.

The decoder is vLLM's own Qwen3-MoE stack (attention with q/k norms, every layer sparse, a shared
expert behind a sigmoid gate) over `talker_config.text_config`; its token embedding is the talker's
`codec_embedding`, so `embed_input_ids(c0)` is the reference's codec row. Prompt rows come from the
input processor (`qwen3_omni_moe.thinker_to_talker`) as prompt embeddings, the text row of each step
through the runner's StepEmbedsAdder.

Sampling may only pick codebook-0 codes or the end of speech: the reference suppresses the top 1024
ids but `codec_eos_token_id` (mask in `compute_logits`).

Each sampled c0 becomes a 16-code frame: when c0 is fed back, `predict_step` (called by the
runner's StepPredictor) runs the code predictor on the hidden state that produced it and adds the
15 residual codes' embeddings to c0's input row, as the reference's next step does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
from vllm.sequence import IntermediateTensors

from omni_server.models.masking import suppress
from omni_server.models.qwen3_omni_moe.code_predictor import CodePredictor

PREFIX = "talker."
SUPPRESSED_TOP = 1024  # the reference never samples the last 1024 ids, except the end of speech


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class _Decoder(Qwen3MoeModel):
    """vLLM's Qwen3-MoE stack, compiled with the token count on the LAST dim of `positions`: its
    M-RoPE positions are (3, tokens), and the parent's compile marks dim 0 (which pins the token
    count to the first size it is traced with)."""


CODE_PREDICTOR_OPTIONS = {"compile": bool, "cuda_graphs": bool, "max_graph_batch": int}


def code_predictor_options(vllm_config: VllmConfig) -> dict:
    """The stage's `engine_args: {additional_config: {code_predictor: {...}}}`: CodePredictor's
    keyword arguments (vLLM passes additional_config through to the model untouched)."""
    extra = vllm_config.additional_config
    options = extra.get("code_predictor", {}) if isinstance(extra, dict) else {}
    if not isinstance(options, dict):
        raise ValueError(f"additional_config.code_predictor must be a mapping, got {options!r}")
    for key, value in options.items():
        kind = CODE_PREDICTOR_OPTIONS.get(key)
        if kind is None or type(value) is not kind:
            raise ValueError(f"additional_config.code_predictor.{key}: {value!r} is not one of "
                             + ", ".join(f"{k} ({t.__name__})" for k, t in CODE_PREDICTOR_OPTIONS.items()))
    return options


def banned_ids(vocab_size: int, eos: int) -> torch.Tensor:
    banned = torch.zeros(vocab_size, dtype=torch.bool)
    banned[vocab_size - SUPPRESSED_TOP:] = True
    banned[eos] = False
    return banned


class Qwen3OmniMoeTalker(nn.Module, SupportsMRoPE):
    """vLLM model for `model_class: qwen3_omni_moe.talker` (hf_config = the checkpoint's talker_config).
    Its prompt positions (M-RoPE) come from the input processor (`StageInput.positions`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        text = config.text_config
        self.config = config
        self.model = _Decoder(vllm_config=vllm_config, prefix=f"{prefix}model")
        self.codec_head = ParallelLMHead(text.vocab_size, text.hidden_size, quant_config=vllm_config.quant_config,
                                         prefix=f"{prefix}codec_head")
        self.logits_processor = LogitsProcessor(text.vocab_size)
        self.register_buffer("banned_ids", banned_ids(text.vocab_size, config.codec_eos_token_id), persistent=False)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        # Its own weights, read from the checkpoint now (vLLM's loader sees only the decoder's).
        self.code_predictor = CodePredictor(vllm_config.model_config.model, self.banned_ids.device,
                                            vllm_config.model_config.dtype, **code_predictor_options(vllm_config))
        # (On CUDA: its graphs for every batch the engine may run, captured now, before vLLM sizes
        # its KV cache from the memory left.)
        self.code_predictor.warm_up(vllm_config.scheduler_config.max_num_seqs)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features) -> tuple[torch.Tensor, int]:
        """A prompt that came without positions: text positions 0, 1, 2, ... in every section."""
        return torch.arange(len(input_tokens)).expand(3, -1).clone(), 0

    def predict_step(self, hidden: torch.Tensor, token_embeds: torch.Tensor, generators):
        return self.code_predictor(hidden, token_embeds, generators)

    def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return suppress(self.logits_processor(self.codec_head, hidden_states), self.banned_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder and codec head out of a full checkpoint; the thinker, the projections (the
        input processor's), the code predictor and code2wav are skipped."""
        head = dict(self.codec_head.named_parameters())
        loaded: set[str] = set()

        def decoder():
            for name, tensor in weights:
                if name.startswith(PREFIX + "model."):
                    rest = name[len(PREFIX + "model."):]
                    yield ("embed_tokens." + rest[len("codec_embedding."):]
                           if rest.startswith("codec_embedding.") else rest), tensor
                elif name.startswith(PREFIX + "codec_head."):
                    param = head[name[len(PREFIX + "codec_head."):]]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                    loaded.add("codec_head." + name[len(PREFIX + "codec_head."):])

        loaded |= {"model." + n for n in self.model.load_weights(decoder())}
        return loaded
