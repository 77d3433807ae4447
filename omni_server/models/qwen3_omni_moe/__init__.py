"""Qwen3-Omni-MoE: the thinker is vLLM's own model with its image/video rope positions corrected
(`qwen3_omni_moe.thinker`). The code2wav is a generator (`qwen3_omni_moe.code2wav`); the
thinker -> talker input processor is `qwen3_omni_moe.thinker_to_talker`. The talker and code
predictor model class is not built yet (docs/qwen3_omni.md).
"""

from omni_server.models.qwen3_omni_moe import processors  # noqa: F401  (registers the processors)
from omni_server.stage import generators, model_classes

model_classes.register("qwen3_omni_moe.thinker", model_classes.ModelClass(
    architecture="OmniServerQwen3OmniMoeThinker",
    target="omni_server.models.qwen3_omni_moe.thinker:Qwen3OmniMoeThinker",
))

generators.register("qwen3_omni_moe.code2wav", "omni_server.models.qwen3_omni_moe.code2wav:Code2Wav")
