"""Qwen2.5-Omni: thinker (vLLM's own model) -> talker (ours, in vLLM) -> token2wav (a generator).

Importing the package registers the pieces the YAML names: `qwen2_5_omni.thinker` (vLLM's thinker
with transformers' positions for audio in video), `qwen2_5_omni.talker` (model classes),
`qwen2_5_omni.thinker_to_talker` / `qwen2_5_omni.talker_to_token2wav` (input processors) and
`qwen2_5_omni.token2wav` (generator). Heavy modules load only when a stage uses them.
"""

from omni_server.models.qwen2_5_omni import processors  # noqa: F401  (registers the processors)
from omni_server.stage import generators, model_classes
from omni_server.wire.messages import VIDEO_FPS

def _audio_in_video(videos: int) -> dict:
    # (`second_per_grid_ts`: transformers' temporal_patch_size (2) / fps at the api's frame rate;
    # vLLM's default, 1 s, is that at 2 frames a second only)
    return {"use_audio_in_video": True, "second_per_grid_ts": [2 / VIDEO_FPS] * videos}


model_classes.register("qwen2_5_omni.thinker", model_classes.ModelClass(
    architecture="OmniServerQwen2_5OmniThinker",
    target="omni_server.models.qwen2_5_omni.thinker:Qwen2_5OmniThinker",
    audio_in_video=_audio_in_video,
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
