"""Qwen2.5-Omni: thinker (vLLM's own model) -> talker (ours, in vLLM) -> token2wav (a generator).

Importing the package registers the pieces the YAML names: `qwen2_5_omni.thinker` (vLLM's thinker
with transformers' positions for audio in video), `qwen2_5_omni.talker` (model classes),
`qwen2_5_omni.thinker_to_talker` / `qwen2_5_omni.talker_to_token2wav` (input processors) and
`qwen2_5_omni.token2wav` (generator). Heavy modules load only when a stage uses them.
"""

from omni_server.models.qwen2_5_omni import processors  # noqa: F401  (registers the processors)
from omni_server.models.omni_media import audio_in_video_kwargs, video_tokens
from omni_server.stage import generators, model_classes


model_classes.register("qwen2_5_omni.thinker", model_classes.ModelClass(
    architecture="OmniServerQwen2_5OmniThinker",
    target="omni_server.models.qwen2_5_omni.thinker:Qwen2_5OmniThinker",
    audio_in_video=audio_in_video_kwargs,
    video_tokens=video_tokens,
))


model_classes.register("qwen2_5_omni.talker", model_classes.ModelClass(
    architecture="OmniServerQwen2_5OmniTalker",
    target="omni_server.models.qwen2_5_omni.talker:Qwen2_5OmniTalker",
    sub_config="talker_config",
    # The talker reads embeddings, never text. Its prefix cache keys blocks by their embeddings'
    # bytes (vLLM hashes prompt embeds), so a turn whose prompt starts like an earlier one's (the
    # thinker's cached rows are the very same values) reuses that prefix's KV here too.
    engine_defaults={"skip_tokenizer_init": True, "enable_prompt_embeds": True},
))

generators.register("qwen2_5_omni.token2wav", "omni_server.models.qwen2_5_omni.token2wav:Token2Wav")
