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
from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3MoeLLMModel,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)
from vllm.multimodal.utils import copy_mm_embedding_modality
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


class _TagsKept(list):
    """A step's media embeddings; an item replaced keeps the modality tag of the one it replaces."""

    def __setitem__(self, index, value):
        copy_mm_embedding_modality(self[index], value)
        super().__setitem__(index, value)


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
        # vLLM's merge of an audio-in-video span groups a step's media embeddings by the modality its
        # runner tags each with; its own Qwen3 method first replaces each video's embedding by its
        # main part (split from the deepstack features), losing the tag: every such request failed
        # the engine ("Missing modality on multimodal embedding"). Replacements here keep it.
        if multimodal_embeddings:
            multimodal_embeddings = _TagsKept(multimodal_embeddings)
        return super().embed_input_ids(input_ids, multimodal_embeddings, is_multimodal=is_multimodal)

    def get_mrope_input_positions(self, input_tokens, mm_features):
        cfg = self.config
        media = audio_in_video_media(input_tokens, mm_features, cfg)
        if media is not None:
            return rope_positions(len(input_tokens), media, cfg.position_id_per_seconds)
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


def _seq(n: int, start: int) -> np.ndarray:
    return np.broadcast_to(np.arange(start, start + n), (3, n))


def _t_index(grid_t: int, seconds_per_grid: float, per_second: float) -> torch.Tensor:
    # transformers keeps these float32 (positions too); at integral values (2 fps) they equal ours.
    return torch.arange(grid_t) * torch.tensor(seconds_per_grid, dtype=torch.float32) * per_second


def _grid(t_index: torch.Tensor, h: int, w: int, start: int) -> np.ndarray:
    """[3, t*h*w] positions of a (merged) vision grid, frame by frame, row by row."""
    t, hh, ww = np.meshgrid(t_index.long().numpy(), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([t.ravel(), hh.ravel(), ww.ravel()]) + start


def rope_positions(n_tokens: int, media: list[tuple], per_second: float) -> tuple[torch.Tensor, int]:
    """transformers' M-RoPE positions [3, n_tokens] and delta (max + 1 - n_tokens) for a prompt whose
    media are, sorted by `start`: ("image", start, (t, h, w)), ("video", start, (t, h, w), seconds per
    grid), ("audio", start, n) with `start` the first placeholder token, and ("av", start, (t, h, w),
    seconds per grid, n audio tokens) with `start` the <|vision_start|> of an audio-in-video span.
    Grids are in merged units. Each part starts at the previous part's max + 1, as transformers'."""
    parts: list[np.ndarray] = []

    def nxt() -> int:
        return int(parts[-1].max()) + 1 if parts else 0

    st = 0
    for kind, start, *info in media:
        if start > st:
            parts.append(_seq(start - st, nxt()))
        p = nxt()
        if kind == "audio":
            parts.append(_seq(info[0], p))
            st = start + info[0]
            continue
        (t, h, w), spg = info[0], (info[1] if kind != "image" else 1.0)
        t_index = _t_index(t, spg, per_second)
        if kind != "av":
            parts.append(_grid(t_index, h, w, p))
            st = start + parts[-1].shape[1]
            continue
        # Start tokens at p, p + 1; frames and audio from p + 2, merged by time (a frame first on a
        # tie); end tokens at q, q + 1, q the max + 1 of the run of the kind that outlasts the other.
        n_audio = info[2]
        video, audio = _grid(t_index, h, w, p + 2), _seq(n_audio, p + 2)
        vt = t_index.repeat_interleave(h * w).numpy()  # (float: compared as transformers does)
        at_v = np.arange(len(vt)) + np.clip(np.ceil(vt), 0, n_audio).astype(np.int64)  # audio j < t goes first
        at_a = np.arange(n_audio) + np.searchsorted(vt, np.arange(n_audio), side="right")  # frames t <= j first
        span = np.empty((3, len(vt) + n_audio), dtype=np.int64)
        span[:, at_v], span[:, at_a] = video, audio
        last_other = min(at_v[-1], at_a[-1]) if len(vt) and n_audio else -1
        parts += [_seq(2, p), span, _seq(2, int(span[:, last_other + 1:].max()) + 1)]
        st = start + 4 + span.shape[1]
    if st < n_tokens:
        parts.append(_seq(n_tokens - st, nxt()))
    positions = np.concatenate(parts, axis=1)
    if positions.shape[1] != n_tokens:
        raise ValueError(f"M-RoPE positions cover {positions.shape[1]} of {n_tokens} prompt tokens")
    return torch.from_numpy(positions.astype(np.int64)), int(positions.max()) + 1 - n_tokens


def audio_in_video_media(input_tokens: list[int], mm_features, cfg) -> list[tuple] | None:
    """`rope_positions`' media for vLLM's features (offsets as vLLM records them: the first pad, or
    <|audio_start|> for a span), or None when no video holds its audio. A video holds it when its
    placeholder starts at <|audio_start|> (vLLM then lays the audio in it, as the per-item
    `use_audio_in_video` flag asked; it is the layout transformers keys on). Its audio is the audio
    item placed in that range (vLLM gives it the video's)."""
    merge = cfg.vision_config.spatial_merge_size
    spans = {f.mm_position.offset: f.mm_position.offset + f.mm_position.length for f in mm_features
             if f.modality == "video" and input_tokens[f.mm_position.offset] == cfg.audio_start_token_id}
    if not spans:
        return None
    media = []
    for f in sorted(mm_features, key=lambda f: f.mm_position.offset):
        at, n = f.mm_position.offset, f.mm_position.length
        if f.modality == "audio":
            if not any(s <= at < e for s, e in spans.items()):  # (a span's own audio: counted there)
                media.append(("audio", at, input_tokens[at:at + n].count(cfg.audio_token_id)))
            continue
        t, h, w = f.data[f"{f.modality}_grid_thw"].data.tolist()
        grid = (t, h // merge, w // merge)
        if f.modality == "image":
            media.append(("image", at, grid))
            continue
        spg = f.data.get("second_per_grid_ts")
        spg = 2.0 if spg is None else spg.data.item()  # (vLLM's default)
        if at in spans:  # (the span's own tokens tell its audio length: the audio pads in it)
            media.append(("av", at - 1, grid, spg, input_tokens[at:at + n].count(cfg.audio_token_id)))
        else:
            media.append(("video", at, grid, spg))
    return media
