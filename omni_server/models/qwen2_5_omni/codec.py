"""Which talker ids token2wav can decode; shared by our talker and the bench's transformers reference
(no vLLM import here)."""

from __future__ import annotations

import torch

from omni_server.models.checkpoint import read_config


def banned_ids(model: str, talker_config) -> torch.Tensor:
    """[vocab] bool, True for ids the talker must never sample: everything but the codes token2wav
    decodes ([0, num_embeds]) and the two ends of speech. A trained talker never picks them; an
    untrained one (dummy weights) does, and token2wav would reject the whole reply."""
    try:
        codes = read_config(model).token2wav_config.dit_config.num_embeds + 1
    except (OSError, AttributeError, ValueError):
        codes = talker_config.tts_codec_pad_token_id
    banned = torch.ones(talker_config.vocab_size, dtype=torch.bool)
    banned[:codes] = False
    banned[[talker_config.tts_codec_pad_token_id, talker_config.tts_codec_end_token_id]] = False
    return banned
