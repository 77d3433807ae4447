"""Qwen3-Omni-MoE: the thinker is vLLM's own model with its image/video rope positions corrected
(`qwen3_omni_moe.thinker`). The code2wav is a generator
(`qwen3_omni_moe.code2wav`); the talker and code predictor stages are not built yet.
"""

from omni_server.stage import generators, model_classes

model_classes.register("qwen3_omni_moe.thinker", model_classes.ModelClass(
    architecture="OmniServerQwen3OmniMoeThinker",
    target="omni_server.models.qwen3_omni_moe.thinker:Qwen3OmniMoeThinker",
))

generators.register("qwen3_omni_moe.code2wav", "omni_server.models.qwen3_omni_moe.code2wav:Code2Wav")
