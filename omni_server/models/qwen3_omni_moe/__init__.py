"""Qwen3-Omni-MoE: the thinker is vLLM's own model with its image/video rope positions corrected
(`qwen3_omni_moe.thinker`). The talker, code predictor and code2wav stages are not built yet.
"""

from omni_server.stage import model_classes

model_classes.register("qwen3_omni_moe.thinker", model_classes.ModelClass(
    architecture="OmniServerQwen3OmniMoeThinker",
    target="omni_server.models.qwen3_omni_moe.thinker:Qwen3OmniMoeThinker",
))
