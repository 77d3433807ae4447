"""vLLM's Qwen3-Omni-MoE thinker with transformers' 3-D rope positions for media.

vLLM 0.26's `get_mrope_input_positions` reads each media item's placeholder offset as the index of
its start token (<|vision_start|> / <|audio_start|>), but vLLM's processor records the offset of the
first pad token, one later. The image grid then starts one token late and every image prompt decodes
differently from transformers (audio is 1-D and sequential, so the shift does not show there). Here
the positions are computed from offsets moved back onto the start tokens.
"""

from __future__ import annotations

import dataclasses

from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3OmniMoeThinkerForConditionalGeneration


class Qwen3OmniMoeThinker(Qwen3OmniMoeThinkerForConditionalGeneration):
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
