"""vLLM's Qwen3-Omni-MoE thinker with transformers' 3-D rope positions for media, emitting the
residual stream the talker reads.

Positions: vLLM 0.26's `get_mrope_input_positions` reads each media item's placeholder offset as the
index of its start token (<|vision_start|> / <|audio_start|>), but vLLM's processor records the
offset of the first pad token, one later. The image grid then starts one token late and every image
prompt decodes differently from transformers (audio is 1-D and sequential, so the shift does not show
there). Here the positions are computed from offsets moved back onto the start tokens.

Talker input: the talker reads the residual stream entering decoder layer `accept_hidden_layer`
(transformers' `hidden_states[accept_hidden_layer]`: after the previous layer, before its deepstack
add), not the final normed state. The LLM stack's forward also returns that stream as an auxiliary
output, the way vLLM's EAGLE-3 target models do (`set_aux_hidden_state_layers`); the stage's runner
turns auxiliary outputs on for models that name an `emitted_hidden_layer` and emits those rows.
"""

from __future__ import annotations

import dataclasses

from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from vllm.distributed import get_pp_group
from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3MoeLLMModel,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)
from vllm.sequence import IntermediateTensors


class _LLMWithTap(Qwen3MoeLLMModel):
    """vLLM's Qwen3-Omni LLM stack; its forward also returns the residual stream entering each layer
    in `aux_hidden_state_layers` (taken before the previous layer's deepstack add)."""

    aux_hidden_state_layers: tuple[int, ...] = ()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                deepstack_input_embeds=None):
        if get_pp_group().is_first_rank:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        taps = []
        if self.start_layer in self.aux_hidden_state_layers:
            taps.append(hidden if residual is None else hidden + residual)
        for idx in range(self.start_layer, self.end_layer):
            hidden, residual = self.layers[idx](positions, hidden, residual)
            if idx + 1 in self.aux_hidden_state_layers:  # vLLM defers the residual add: the stream is the sum
                taps.append(hidden + residual)
            if deepstack_input_embeds is not None and idx < len(deepstack_input_embeds):
                hidden = hidden + deepstack_input_embeds[f"deepstack_input_embeds_{idx}"]
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return (hidden, taps) if self.aux_hidden_state_layers else hidden


class Qwen3OmniMoeThinker(Qwen3OmniMoeThinkerForConditionalGeneration):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # Our LLM stack class on the instance this model built (same modules and weights; only the
        # forward differs): the parent constructs it itself, and a second one would double its memory.
        llm = self.language_model.model
        llm.__class__ = _LLMWithTap
        # vLLM's compile wrapper (support_torch_compile) took the bound forward when the stack was
        # built, before the swap: without a new one, compiled runs trace the parent's forward (no taps).
        if not getattr(llm, "do_not_compile", True):
            llm.cleanup()  # its bytecode hook watches the old forward
            TorchCompileWithNoGuardsWrapper.__init__(llm)
        talker = getattr(vllm_config.model_config.hf_config, "talker_config", None)
        self.emitted_hidden_layer: int | None = getattr(talker, "accept_hidden_layer", None)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.language_model.model.aux_hidden_state_layers = tuple(layers)

    def get_mrope_input_positions(self, input_tokens, mm_features):
        cfg = self.config
        start_of = {cfg.image_token_id: cfg.vision_start_token_id, cfg.video_token_id: cfg.vision_start_token_id,
                    cfg.audio_token_id: cfg.audio_start_token_id}
        moved = []
        for f in mm_features:
            at = f.mm_position.offset
            pad = input_tokens[at] if at < len(input_tokens) else None
            if at > 0 and pad in start_of and input_tokens[at - 1] == start_of[pad]:
                f = dataclasses.replace(f, mm_position=dataclasses.replace(f.mm_position, offset=at - 1))
            moved.append(f)
        return super().get_mrope_input_positions(input_tokens, moved)
