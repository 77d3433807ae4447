"""Qwen3-Omni-MoE: the thinker is vLLM's own model with its image/video rope positions corrected
(`qwen3_omni_moe.thinker`). The code2wav is a generator (`qwen3_omni_moe.code2wav`); the
thinker -> talker input processor is `qwen3_omni_moe.thinker_to_talker`; the talker
(`qwen3_omni_moe.talker`) is its MoE decoder plus the code predictor that completes each frame
(docs/qwen3_omni.md).
"""

from omni_server.models.qwen3_omni_moe import processors  # noqa: F401  (registers the processors)
from omni_server.models.omni_media import audio_in_video_kwargs, video_tokens
from omni_server.stage import generators, model_classes


model_classes.register("qwen3_omni_moe.thinker", model_classes.ModelClass(
    architecture="OmniServerQwen3OmniMoeThinker",
    target="omni_server.models.qwen3_omni_moe.thinker:Qwen3OmniMoeThinker",
    audio_in_video=audio_in_video_kwargs,
    video_tokens=video_tokens,
))


def _talker_mrope(config) -> None:
    # transformers' talker always interleaves its M-RoPE sections (its rotary ignores the flags; the
    # published config has `interleaved` but not vLLM's `mrope_interleaved`).
    text = config.text_config
    text.rope_parameters = {**text.rope_parameters, "mrope_interleaved": True}


model_classes.register("qwen3_omni_moe.talker", model_classes.ModelClass(
    architecture="OmniServerQwen3OmniMoeTalker",
    target="omni_server.models.qwen3_omni_moe.talker:Qwen3OmniMoeTalker",
    sub_config="talker_config",
    # The talker reads embeddings, never text. Its prefix cache keys blocks by their embeddings' bytes:
    # a conversation's earlier user turns (text rows, or the thinker's cached rows of its media) hit.
    engine_defaults={"skip_tokenizer_init": True, "enable_prompt_embeds": True},
    adapt_config=_talker_mrope,
))

generators.register("qwen3_omni_moe.code2wav", "omni_server.models.qwen3_omni_moe.code2wav:Code2Wav")
