"""vLLM's Qwen2.5-Omni thinker with transformers' M-RoPE positions for audio in video.

With `use_audio_in_video` vLLM 0.26 lays a video and its audio track out as transformers does,
<|vision_bos|><|audio_bos|> [2 s chunks: frames, then audio] <|audio_eos|><|vision_eos|>, but numbers
the span differently: it starts the media at <|audio_bos|> (the placeholder's offset), one token late.
transformers (`get_rope_index(..., use_audio_in_video=True)`) gives both bos tokens p, the media
p + 1 on, and both eos tokens the last chunk's max + 1. Prompts holding such a span get
transformers' positions (`rope_positions`); all others keep vLLM's.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerForConditionalGeneration


def _seq(n: int, start: int) -> np.ndarray:
    return np.broadcast_to(np.arange(start, start + n), (3, n))


def _grid(t_index: np.ndarray, h: int, w: int, start: int) -> np.ndarray:
    """[3, t*h*w] positions of a (merged) vision grid, frame by frame, row by row."""
    t, hh, ww = np.meshgrid(t_index, np.arange(h), np.arange(w), indexing="ij")
    return np.stack([t.ravel(), hh.ravel(), ww.ravel()]) + start


def _t_index(grid_t: int, seconds_per_grid: float, per_second: float) -> np.ndarray:
    # transformers scales in float32 and truncates; float64 could round some products the other way.
    return (torch.arange(grid_t) * torch.tensor(seconds_per_grid, dtype=torch.float32) * per_second).long().numpy()


def _chunks(values: np.ndarray, size: int) -> list[tuple[int, int]]:
    """transformers' `get_chunked_index`: split a non-decreasing sequence where it reaches the next
    multiple of `size` (one split per element at most, so a jump over several multiples splits once)."""
    bounds, start, k = [], 0, 1
    for i, v in enumerate(values.tolist()):
        if v >= k * size:
            bounds.append((start, i))
            start, k = i, k + 1
    return bounds + [(start, len(values))]


def rope_positions(n_tokens: int, media: list[tuple], per_second: float,
                   chunk_seconds: float) -> tuple[torch.Tensor, int]:
    """transformers' M-RoPE positions [3, n_tokens] and delta (max + 1 - n_tokens) for a prompt whose
    media are, sorted by `start`: ("image", start, (t, h, w)), ("video", start, (t, h, w), seconds per
    grid), ("audio", start, n) with `start` the first placeholder token, and ("av", start, (t, h, w),
    seconds per grid, n audio tokens) with `start` the <|vision_bos|> of an audio-in-video span.
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
        grid = _grid(_t_index(t, spg, per_second), h, w, p + 1 if kind == "av" else p)
        if kind != "av":
            parts.append(grid)
            st = start + grid.shape[1]
            continue
        # Both bos tokens at p; frames and audio from p + 1, chunk by chunk (a chunk's frames, then
        # its audio); both eos tokens at the max + 1 of the last part appended.
        n_audio = info[2]
        audio = _seq(n_audio, p + 1)
        size = int(per_second * chunk_seconds)
        vc, ac = _chunks(grid[0] - (p + 1), size), _chunks(audio[0] - (p + 1), size)
        parts += [_seq(1, p), _seq(1, p)]
        for j in range(max(len(vc), len(ac))):
            parts += [grid[:, slice(*vc[j])]] if j < len(vc) else []
            parts += [audio[:, slice(*ac[j])]] if j < len(ac) else []
        q = nxt()
        parts += [_seq(1, q), _seq(1, q)]
        st = start + 4 + grid.shape[1] + n_audio
    if st < n_tokens:
        parts.append(_seq(n_tokens - st, nxt()))
    positions = np.concatenate(parts, axis=1)
    if positions.shape[1] != n_tokens:
        raise ValueError(f"M-RoPE positions cover {positions.shape[1]} of {n_tokens} prompt tokens")
    return torch.from_numpy(positions.astype(np.int64)), int(positions.max()) + 1 - n_tokens


def audio_in_video_media(input_tokens: list[int], mm_features, cfg) -> list[tuple] | None:
    """`rope_positions`' media for vLLM's features, or None when no video holds its audio. A video
    holds it when its placeholder starts at <|audio_bos|> (vLLM then lays the audio in it, as the
    per-item `use_audio_in_video` flag asked; it is the layout transformers keys on). Its audio is
    the audio item placed in that range (vLLM gives it the video's)."""
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
        spg = 1.0 if spg is None else spg.data.item()  # (vLLM's default)
        if at in spans:  # (the span's own tokens tell its audio length: the audio pads in it)
            media.append(("av", at - 1, grid, spg, input_tokens[at:at + n].count(cfg.audio_token_id)))
        else:
            media.append(("video", at, grid, spg))
    return media


class Qwen2_5OmniThinker(Qwen2_5OmniThinkerForConditionalGeneration):
    def get_mrope_input_positions(self, input_tokens, mm_features):
        media = audio_in_video_media(input_tokens, mm_features, self.config)
        if media is None:
            return super().get_mrope_input_positions(input_tokens, mm_features)
        return rope_positions(len(input_tokens), media, self.config.position_id_per_seconds,
                              self.config.seconds_per_chunk)
