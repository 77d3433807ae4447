"""vLLM's Qwen3-Omni-MoE thinker with transformers' 3-D rope positions for media, emitting the
residual stream the talker reads.

Positions: vLLM 0.26's `get_mrope_input_positions` reads each media item's placeholder offset as the
index of its start token (<|vision_start|> / <|audio_start|>), but vLLM's processor records the
offset of the first pad token, one later. The image grid then starts one token late and every image
prompt decodes differently from transformers (audio is 1-D and sequential, so the shift does not show
there). Here the positions are computed from offsets moved back onto the start tokens. A video holding
its audio (`use_audio_in_video`: <|vision_start|><|audio_start|> frames and audio merged by time
<|audio_end|><|vision_end|>) vLLM numbers differently again (both start tokens at p, media from p + 1);
transformers gives the start tokens p, p + 1, the media p + 2 on and the end tokens q, q + 1 (q: the
last part's max + 1). Prompts holding such a span get transformers' positions (`rope_positions`).
A step holding video and audio tokens is merged by modality (`embed_input_ids`; omni_media says why).

Talker input: the talker reads the residual stream entering decoder layer `accept_hidden_layer`
(transformers' `hidden_states[accept_hidden_layer]`: after the previous layer, before its deepstack
add), not the final normed state. The LLM stack's forward also returns that stream as an auxiliary
output, the way vLLM's EAGLE-3 target models do (`set_aux_hidden_state_layers`); the stage's runner
turns auxiliary outputs on for models that name an `emitted_hidden_layer` and emits those rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from vllm.distributed import get_pp_group
from vllm.model_executor.models.qwen2_5_omni_thinker import merge_interleaved_embeddings
from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3MoeLLMModel,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)
from vllm.multimodal.utils import copy_mm_embedding_modality
from vllm.sequence import IntermediateTensors

from omni_server.models import omni_media
from omni_server.models.omni_media import audio_in_video_media, grid, or_none, seq, t_index, video_and_audio


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

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        cfg = self.config
        both = video_and_audio(input_ids, is_multimodal, cfg.video_token_id,
                               cfg.audio_token_id) if multimodal_embeddings else None
        if both is None:
            return super().embed_input_ids(input_ids, multimodal_embeddings, is_multimodal=is_multimodal)
        # By modality (omni_media.video_and_audio says why). vLLM's own method also lost the modality
        # tags where it splits a video's embedding from its deepstack features: every audio-in-video
        # request failed the engine ("Missing modality on multimodal embedding").
        text = self._embed_text_input_ids(input_ids, self.language_model.embed_input_ids, is_multimodal=is_multimodal)
        levels = len(self.visual.deepstack_visual_indexes or ())
        main, deep = [], []
        for e in multimodal_embeddings:
            if levels and e.shape[-1] != cfg.text_config.hidden_size:  # (vision: its features, then each level's)
                dim = e.shape[-1] // (levels + 1)
                m, d = e.split([dim, dim * levels], dim=-1)
                main.append(copy_mm_embedding_modality(e, m))
                deep.append(d)
            else:
                main.append(e)
        if deep:  # (vision rows in token order: the features' order)
            vision = is_multimodal & ~both[1]
            stack = text.new_zeros(text.shape[0], levels * dim)
            stack[vision.to(text.device)] = torch.cat(deep).to(text.dtype)
            self._set_deepstack_input_embeds(stack.view(text.shape[0], levels, dim).permute(1, 0, 2).contiguous())
        return merge_interleaved_embeddings(text, main, *both, is_multimodal)

    def get_mrope_input_positions(self, input_tokens, mm_features):
        cfg = self.config
        media = audio_in_video_media(input_tokens, mm_features, cfg, 2.0)
        made = media and or_none(lambda: rope_positions(len(input_tokens), media, cfg.position_id_per_seconds))
        if made:
            return made
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


def rope_positions(n_tokens: int, media: list[tuple], per_second: float) -> tuple[torch.Tensor, int]:
    """transformers' M-RoPE positions and delta for a prompt with audio-in-video spans (omni_media)."""

    def span(p: int, thw: tuple, spg: float, n_audio: int) -> list[np.ndarray]:
        # Start tokens at p, p + 1; frames and audio from p + 2, merged by time (a frame first on a
        # tie); end tokens at q, q + 1, q the max + 1 of the run of the kind that outlasts the other.
        times = t_index(thw[0], spg, per_second)
        video, audio = grid(times, *thw[1:], p + 2), seq(n_audio, p + 2)
        vt = times.repeat_interleave(thw[1] * thw[2]).numpy()  # (float: compared as transformers does)
        at_v = np.arange(len(vt)) + np.clip(np.ceil(vt), 0, n_audio).astype(np.int64)  # audio j < t goes first
        at_a = np.arange(n_audio) + np.searchsorted(vt, np.arange(n_audio), side="right")  # frames t <= j first
        merged = np.empty((3, len(vt) + n_audio), dtype=np.int64)
        merged[:, at_v], merged[:, at_a] = video, audio
        last_other = min(at_v[-1], at_a[-1]) if len(vt) and n_audio else -1
        return [seq(2, p), merged, seq(2, int(merged[:, last_other + 1:].max()) + 1)]

    return omni_media.rope_positions(n_tokens, media, per_second, span)
