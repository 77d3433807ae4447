"""Qwen3-Omni-MoE: the thinker is vLLM's own model with its image/video rope positions corrected
(`qwen3_omni_moe.thinker`). The code2wav is a generator (`qwen3_omni_moe.code2wav`); the
thinker -> talker input processor is `qwen3_omni_moe.thinker_to_talker`; the talker
(`qwen3_omni_moe.talker`) is its MoE decoder plus the code predictor that completes each frame
(docs/qwen3_omni.md).
"""

from omni_server.models.qwen3_omni_moe import processors  # noqa: F401  (registers the processors)
from omni_server.stage import generators, model_classes

model_classes.register("qwen3_omni_moe.thinker", model_classes.ModelClass(
    architecture="OmniServerQwen3OmniMoeThinker",
    target="omni_server.models.qwen3_omni_moe.thinker:Qwen3OmniMoeThinker",
))


def _talker_positions_1d(config) -> None:
    # Text and audio prompts give the talker the same position in every M-RoPE section: plain RoPE
    # (image prompts' 3-D positions are not sent to this talker yet).
    text = config.text_config
    text.rope_parameters = {k: v for k, v in text.rope_parameters.items()
                            if k not in ("mrope_section", "interleaved", "mrope_interleaved")}


model_classes.register("qwen3_omni_moe.talker", model_classes.ModelClass(
    architecture="OmniServerQwen3OmniMoeTalker",
    target="omni_server.models.qwen3_omni_moe.talker:Qwen3OmniMoeTalker",
    sub_config="talker_config",
    # The talker reads embeddings, never text; prefix caching would skip the per-request prompt rows.
    engine_defaults={"skip_tokenizer_init": True, "enable_prompt_embeds": True, "enable_prefix_caching": False},
    adapt_config=_talker_positions_1d,
))

generators.register("qwen3_omni_moe.code2wav", "omni_server.models.qwen3_omni_moe.code2wav:Code2Wav")
