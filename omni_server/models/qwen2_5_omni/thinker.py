"""vLLM's Qwen2.5-Omni thinker with transformers' M-RoPE positions for audio in video.

With `use_audio_in_video` vLLM 0.26 lays a video and its audio track out as transformers does,
<|vision_bos|><|audio_bos|> [2 s chunks: frames, then audio] <|audio_eos|><|vision_eos|>, but numbers
the span differently: it starts the media at <|audio_bos|> (the placeholder's offset), one token late.
transformers (`get_rope_index(..., use_audio_in_video=True)`) gives both bos tokens p, the media
p + 1 on, and both eos tokens the last chunk's max + 1. Prompts holding such a span get
transformers' positions (`rope_positions`); all others keep vLLM's. A step holding video and audio
tokens is merged by modality (`embed_input_ids`; omni_media.video_and_audio says why).
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.model_executor.models.qwen2_5_omni_thinker import (
    Qwen2_5OmniThinkerForConditionalGeneration,
    merge_interleaved_embeddings,
)

from omni_server.models import omni_media
from omni_server.models.omni_media import audio_in_video_media, grid, or_none, seq, t_index, video_and_audio


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
    """transformers' M-RoPE positions and delta for a prompt with audio-in-video spans (omni_media)."""

    def span(p: int, thw: tuple, spg: float, n_audio: int) -> list[np.ndarray]:
        # Both bos tokens at p; frames and audio from p + 1, chunk by chunk (a chunk's frames, then
        # its audio); both eos tokens at the max + 1 of the last part appended.
        video, audio = grid(t_index(thw[0], spg, per_second), *thw[1:], p + 1), seq(n_audio, p + 1)
        size = int(per_second * chunk_seconds)
        vc, ac = _chunks(video[0] - (p + 1), size), _chunks(audio[0] - (p + 1), size)
        parts = [seq(1, p), seq(1, p)]
        for j in range(max(len(vc), len(ac))):
            parts += [video[:, slice(*vc[j])]] if j < len(vc) and vc[j][1] > vc[j][0] else []
            parts += [audio[:, slice(*ac[j])]] if j < len(ac) and ac[j][1] > ac[j][0] else []
        q = int(parts[-1].max()) + 1
        return parts + [seq(1, q), seq(1, q)]

    return omni_media.rope_positions(n_tokens, media, per_second, span)


class Qwen2_5OmniThinker(Qwen2_5OmniThinkerForConditionalGeneration):
    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        both = video_and_audio(input_ids, is_multimodal, self.config.video_token_index,
                               self.config.audio_token_index) if multimodal_embeddings else None
        if both is None:
            return super().embed_input_ids(input_ids, multimodal_embeddings, is_multimodal=is_multimodal)
        text = self._embed_text_input_ids(input_ids, self.get_language_model().embed_input_ids,
                                          is_multimodal=is_multimodal)
        return merge_interleaved_embeddings(text, multimodal_embeddings, *both, is_multimodal)

    def get_mrope_input_positions(self, input_tokens, mm_features):
        cfg = self.config
        media = audio_in_video_media(input_tokens, mm_features, cfg, 1.0)
        made = media and or_none(lambda: rope_positions(len(input_tokens), media, cfg.position_id_per_seconds,
                                                        cfg.seconds_per_chunk))
        return made or super().get_mrope_input_positions(input_tokens, mm_features)
