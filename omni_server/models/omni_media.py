"""What Qwen Omni thinkers read of a prompt's media for their positions and embeddings (both families
lay a video that holds its audio track out the same way: `use_audio_in_video`)."""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from omni_server.wire.messages import VIDEO_FPS

log = logging.getLogger(__name__)


def audio_in_video_kwargs(videos: int) -> dict:
    """The processor kwargs that interleave each of a prompt's videos with its audio track (both
    thinkers' `ModelClass.audio_in_video`). `second_per_grid_ts`: transformers' temporal_patch_size
    (2) / fps at the api's frame rate; vLLM's defaults (Qwen2.5 1 s, Qwen3 2 s) need not be that, and
    Qwen3's processor orders the interleaved frames and audio by it."""
    return {"use_audio_in_video": True, "second_per_grid_ts": [2 / VIDEO_FPS] * videos}


# Processor kwargs under which `video_tokens` counts (the stage's own: frame rate, audio in video).
_COUNTED_KWARGS = {"fps", "use_audio_in_video", "second_per_grid_ts"}


def video_tokens(hf_processor, mm_kwargs: dict, frames: int, height: int, width: int) -> int | None:
    """The tokens a video of `frames` frames of `height` x `width` pixels takes in a Qwen Omni
    thinker's prompt, as its transformers processor lays one out (both thinkers'
    `ModelClass.video_tokens`): each frame resized by smart_resize within the processor's video
    size (its kwargs class's defaults win over the video processor's own, as the processor merges
    them), frames padded to the temporal patch, patches merged. None where other kwargs or the
    video processor's settings could lay it out otherwise (sampled frames, a per-frame pixel cap):
    the processor alone counts then."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

    vp = hf_processor.video_processor
    if (set(mm_kwargs) - _COUNTED_KWARGS or vp.do_sample_frames or not vp.do_resize
            or getattr(vp, "cap_pixels_per_frame", True)):  # (transformers after 5.21: capped, the attribute gone)
        return None
    size = hf_processor.valid_processor_kwargs._defaults.get("videos_kwargs", {}).get("size", {})
    factor = vp.patch_size * vp.merge_size
    try:
        h, w = smart_resize(height, width, factor=factor, min_pixels=size.get("shortest_edge", vp.size.shortest_edge),
                            max_pixels=size.get("longest_edge", vp.size.longest_edge))
    except ValueError:  # (a shape the processor refuses: it says why)
        return None
    return -(-frames // vp.temporal_patch_size) * (h // factor) * (w // factor)


def seq(n: int, start: int) -> np.ndarray:
    """[3, n] text positions from `start`."""
    return np.broadcast_to(np.arange(start, start + n), (3, n))


def audio_in_video_media(input_tokens: list[int], mm_features, cfg, default_seconds_per_grid: float) -> list[tuple] | None:
    """A prompt's media as the thinkers' `rope_positions` take them, from vLLM's features (offsets as
    vLLM records them: the first pad, or the audio start token for a span), sorted: ("image", start,
    (t, h, w)), ("video", start, (t, h, w), seconds per grid), ("audio", start, n) and ("av", start,
    (t, h, w), seconds per grid, n audio tokens) with `start` the span's vision start token; grids in
    merged units. None when no video holds its audio.

    A video holds it when its placeholder starts at the audio start token (vLLM then lays the audio
    in it, as the item's `use_audio_in_video` asked; it is the layout transformers keys on); its audio
    is the audio item placed in that range (vLLM gives it the video's), its length the audio pads in
    it. `default_seconds_per_grid`: vLLM's for a video item without one."""
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
        spg = default_seconds_per_grid if spg is None else spg.data.item()
        if at in spans:
            media.append(("av", at - 1, grid, spg, input_tokens[at:at + n].count(cfg.audio_token_id)))
        else:
            media.append(("video", at, grid, spg))
    return media


def t_index(grid_t: int, seconds_per_grid: float, per_second: float) -> torch.Tensor:
    """A video grid's time positions, float32 as transformers computes them (it truncates them for
    the grid, and Qwen3 compares them unrounded with audio positions)."""
    return torch.arange(grid_t) * torch.tensor(seconds_per_grid, dtype=torch.float32) * per_second


def grid(times: torch.Tensor, h: int, w: int, start: int) -> np.ndarray:
    """[3, t*h*w] positions of a (merged) vision grid, frame by frame, row by row."""
    t, hh, ww = np.meshgrid(times.long().numpy(), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([t.ravel(), hh.ravel(), ww.ravel()]) + start


def rope_positions(n_tokens: int, media: list[tuple], per_second: float,
                   span: Callable[[int, tuple, float, int], list[np.ndarray]]) -> tuple[torch.Tensor, int]:
    """transformers' M-RoPE positions [3, n_tokens] and delta (max + 1 - n_tokens) for a prompt of
    `media` (`audio_in_video_media`): each part starts at the previous part's max + 1; `span(p,
    (t, h, w), seconds per grid, n audio tokens)` lays out an audio-in-video span from its vision
    start token at position p (the model's own rule)."""
    parts: list[np.ndarray] = []
    st = 0
    for kind, start, *info in media:
        p = int(parts[-1].max()) + 1 if parts else 0
        if start > st:
            parts.append(seq(start - st, p))
            p += start - st
        if kind == "audio":
            made = [seq(info[0], p)] if info[0] else []
        elif kind == "av":
            made = span(p, *info)
        else:
            (t, h, w), spg = info[0], (info[1] if kind == "video" else 1.0)
            made = [grid(t_index(t, spg, per_second), h, w, p)]
        parts += made
        st = start + sum(m.shape[1] for m in made)
    if st < n_tokens:
        parts.append(seq(n_tokens - st, int(parts[-1].max()) + 1 if parts else 0))
    positions = np.concatenate(parts, axis=1)
    if positions.shape[1] != n_tokens:
        raise ValueError(f"M-RoPE positions cover {positions.shape[1]} of {n_tokens} prompt tokens")
    return torch.from_numpy(positions.astype(np.int64)), int(positions.max()) + 1 - n_tokens


def video_and_audio(input_ids: torch.Tensor, is_multimodal: torch.Tensor | None, video_id: int,
                    audio_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(video, audio) masks of a step's tokens when it holds both kinds; else None.

    vLLM's Qwen Omni thinkers merge such a step by modality only when its video and audio tokens
    interleave within the step; otherwise they lay the step's embeddings out in feature order. A
    chunked prefill that cut a span where its audio comes before the next frames (or an audio part
    beside a video) then put frame embeddings on audio tokens: a wrong reply, no error. Merging by
    modality (`merge_interleaved_embeddings`, on the modality the runner tags each with) is right for
    every such step."""
    if is_multimodal is None:
        return None
    ids = input_ids.cpu()
    video, audio = is_multimodal & (ids == video_id), is_multimodal & (ids == audio_id)
    return (video, audio) if bool(video.any()) and bool(audio.any()) else None


def or_none(compute: Callable[[], tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, int] | None:
    """`compute()`, or None (logged) when it raises: positions are computed in the engine's step,
    where an exception ends the engine and every request on it; vLLM's own are used instead."""
    try:
        return compute()
    except Exception:  # noqa: BLE001
        log.exception("audio-in-video positions failed: the request runs on vLLM's")
        return None
