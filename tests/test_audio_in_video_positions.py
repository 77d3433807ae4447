"""Audio in video (`use_audio_in_video`): the thinkers' M-RoPE positions (and the talkers' prompt
positions built from them) equal transformers' `get_rope_index`, on prompts vLLM's own processor
builds from the request kwargs omni-server sends (`fps`, `use_audio_in_video`, `second_per_grid_ts`).
CPU only: processors and the rope-index functions, no weights loaded (one Qwen3 test runs transformers'
generate on the tiny checkpoint to see what its talker is given)."""

from __future__ import annotations

import copy
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_server.stage import processors
from tests import reference
from omni_server.wire.messages import StagePayload

FPS = 2.0
Q25, Q3 = "tiny-qwen2_5-omni", "tiny-qwen3-omni-moe"


def _frames(n: int, size: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, size, size, 3), dtype=np.uint8)


def _wave(seconds: float, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)


def _image() -> np.ndarray:
    return (np.arange(96 * 160 * 3) % 251).reshape(96, 160, 3).astype(np.uint8)


@lru_cache(maxsize=None)
def _env(model_dir: str):
    """(HF processor, vLLM's multimodal processor, the checkpoint's config) for a tiny checkpoint."""
    from transformers import AutoProcessor
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    mc = ModelConfig(model=model_dir, tokenizer=model_dir, limit_mm_per_prompt={"audio": 2, "video": 2, "image": 1})
    return AutoProcessor.from_pretrained(model_dir), MULTIMODAL_REGISTRY.create_processor(mc), mc.hf_config


def _prompt(model_dir: str, content: list[dict], videos=(), waves=(), images=(), audio_in_video: bool = True,
            history: tuple = ()):
    """(transformers' processor output, the prompt ids vLLM's processor made, the mm_features vLLM's
    input processor would hand the model runner) for a user turn after `history` (text messages)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.multimodal.utils import argsort_mm_positions

    proc, vp, _ = _env(model_dir)
    text = proc.apply_chat_template([*history, {"role": "user", "content": content}], add_generation_prompt=True,
                                    tokenize=False)
    hf = proc(text=text, videos=list(videos) or None, audio=list(waves) or None, images=list(images) or None,
              use_audio_in_video=audio_in_video, fps=FPS, return_tensors="pt")
    # omni-server's request kwargs (stage/ar.py): Qwen3's processor needs second_per_grid_ts for the
    # token order transformers makes at this fps.
    kwargs = {"fps": FPS}
    if audio_in_video:
        kwargs |= {"use_audio_in_video": True, "second_per_grid_ts": [2 / FPS] * len(videos)}
    data = {k: v for k, v in (("video", list(videos)), ("audio", [(w, 16000) for w in waves]),
                              ("image", list(images))) if v}
    out = vp.apply(ProcessorInputs(proc.tokenizer(text)["input_ids"], vp.info.parse_mm_data(data),
                                   hf_processor_mm_kwargs=kwargs), TimingContext(enabled=False))
    ids = out["prompt_token_ids"]
    assert ids == hf["input_ids"][0].tolist()  # (vLLM lays the prompt out as transformers does)
    places = out["mm_placeholders"]
    features = [MultiModalFeatureSpec(data=out["mm_kwargs"][m][i], modality=m, identifier=out["mm_hashes"][m][i],
                                      mm_position=places[m][i], mm_hash=out["mm_hashes"][m][i])
                for m, i in argsort_mm_positions(places)]
    return hf, ids, features


def _spg(hf):
    spg = hf.get("video_second_per_grid")
    return None if spg is None else torch.as_tensor(spg)


def _hf_rope(model_dir: str, hf, audio_in_video: bool, talker: bool = False, ids: torch.Tensor | None = None,
             talker_audio_config: bool = True):
    """transformers' get_rope_index (the thinker's, or the talker's over `ids`): ([3, n], delta).

    transformers 5.17's Qwen3 talker config has no `audio_config`, which its rope index reads for an
    audio it finds beside a video grid: its generate raises AttributeError on an audio-in-video prompt
    when it speaks. `talker_audio_config` lends it the thinker's (the code's intent; the value only
    sizes that audio, and every position there is sequential anyway)."""
    _, _, cfg = _env(model_dir)
    if "qwen3" in model_dir:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m
        cls = m.Qwen3OmniMoeTalkerForConditionalGeneration if talker else m.Qwen3OmniMoeThinkerForConditionalGeneration
    else:
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m
        cls = m.Qwen2_5OmniTalkerForConditionalGeneration if talker else m.Qwen2_5OmniThinkerForConditionalGeneration
    sub = cfg.talker_config if talker else cfg.thinker_config
    if talker and talker_audio_config and "qwen3" in model_dir:
        sub = copy.copy(sub)
        sub.audio_config = cfg.thinker_config.audio_config
    model = object.__new__(cls)  # (the method reads only these two attributes: no weights)
    merge = sub.spatial_merge_size if talker else sub.vision_config.spatial_merge_size
    model.__dict__.update(config=sub, spatial_merge_size=merge)
    ids = hf["input_ids"] if ids is None else ids
    audio = hf.get("feature_attention_mask")
    pos, delta = model.get_rope_index(ids, hf.get("image_grid_thw"), hf.get("video_grid_thw"), torch.ones_like(ids),
                                      audio_in_video, None if audio is None else audio.sum(-1), _spg(hf))
    return pos[:, 0], int(delta.flatten()[0])


def _ours(model_dir: str, ids: list[int], features):
    """Our thinker's get_mrope_input_positions, on an instance without weights (it reads its config)."""
    if "qwen3" in model_dir:
        from omni_server.models.qwen3_omni_moe.thinker import Qwen3OmniMoeThinker as cls
    else:
        from omni_server.models.qwen2_5_omni.thinker import Qwen2_5OmniThinker as cls
    model = object.__new__(cls)
    model.__dict__["config"] = _env(model_dir)[2].thinker_config
    return model, model.get_mrope_input_positions(ids, features)


def _check_thinker(model_dir, hf, ids, features):
    _, (pos, delta) = _ours(model_dir, ids, features)
    want, want_delta = _hf_rope(model_dir, hf, True)
    assert pos.dtype == torch.int64 and pos.shape == (3, len(ids))
    assert torch.equal(pos, want.long()), f"first difference at {int((pos != want).any(0).nonzero()[0])}"
    # Decoding continues 1-D from the prompt's largest position + 1 (vLLM: position = index + delta).
    assert delta == want_delta == int(want.max()) + 1 - len(ids)
    return pos


CASES = {
    # ((frames, audio seconds) per video, an image first, text after the videos)
    "audio_longer": ([(8, 4.3)], False, True),
    "audio_shorter": ([(8, 2.4)], False, True),
    "audio_much_shorter": ([(9, 0.7)], False, True),
    # The span's last part is audio that ends below the video's top position, so its end tokens
    # (and the few tokens after) sit below the prompt's largest position: the talker goes on from
    # the last token, decoding from the largest.
    "video_last": ([(8, 2.4)], False, False),
    "two_videos": ([(4, 2.6), (9, 3.1)], False, True),
    "image_first": ([(6, 3.0)], True, True),
}
HISTORY = ({"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi there."},
           {"role": "assistant", "content": "Hello."})


def _case(name):
    vids, image_first, text_after = CASES[name]
    content = [{"type": "text", "text": "Before the media."}]
    images = [_image()] if image_first else []
    content += [{"type": "image"}] if image_first else []
    videos, waves = [], []
    for i, (n, seconds) in enumerate(vids):
        content += [{"type": "video"}] + ([{"type": "text", "text": f"between {i}"}] if i < len(vids) - 1 else [])
        videos.append(_frames(n, seed=n))
        waves.append(_wave(seconds, seed=i))
    content += [{"type": "text", "text": "What is said in it?"}] if text_after else []
    return content, videos, waves, images


@pytest.mark.parametrize("model", [Q25, Q3])
@pytest.mark.parametrize("name", [*CASES, "multi_turn"])
def test_thinker_positions_equal_transformers(tiny_models, model, name):
    model_dir = str(tiny_models[model])
    turns = name == "multi_turn"  # (the audio_longer turn after a system turn and an exchange)
    content, videos, waves, images = _case("audio_longer" if turns else name)
    hf, ids, features = _prompt(model_dir, content, videos, waves, images, history=HISTORY if turns else ())
    pos = _check_thinker(model_dir, hf, ids, features)
    assert not torch.equal(pos, _vllm_parent(model_dir, ids, features)[0])  # (what vLLM gives differs)


def _vllm_parent(model_dir, ids, features):
    model, _ = _ours(model_dir, ids, [])
    return super(type(model), model).get_mrope_input_positions(ids, features)


@pytest.mark.parametrize("model", [Q25, Q3])
def test_prompts_without_audio_in_video_keep_the_positions_they_had(tiny_models, model):
    """A video without its audio plus a separate audio, and an image: no span, so the positions are
    the ones the class gave before (vLLM's for Qwen2.5, vLLM's with moved offsets for Qwen3), which
    equal transformers' (flag off)."""
    model_dir = str(tiny_models[model])
    content = [{"type": "text", "text": "Look"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "and"},
               {"type": "audio"}, {"type": "text", "text": "listen."}]
    hf, ids, features = _prompt(model_dir, content, [_frames(6)], [_wave(1.5)], [_image()], audio_in_video=False)
    model_obj, (pos, delta) = _ours(model_dir, ids, features)
    if model == Q25:
        want, want_delta = _vllm_parent(model_dir, ids, features)
    else:
        from omni_server.models.omni_media import audio_in_video_media

        assert audio_in_video_media(ids, features, model_obj.config, 2.0) is None  # (the old path)
        want, want_delta = _hf_rope(model_dir, hf, False)
    assert torch.equal(pos, want.long()) and delta == want_delta


# --- talkers -------------------------------------------------------------------------------------

def test_qwen2_5_talker_positions_equal_transformers(tiny_models):
    """transformers' generate passes `use_audio_in_video` on to the Qwen2.5 talker, whose rope index
    over the thinker's prompt + voice token + first reply token is the thinker's, then two text
    positions after the last prompt token (function level: the talker's get_rope_index)."""
    from omni_server.models.qwen2_5_omni.speakers import load_speakers

    model_dir = str(tiny_models[Q25])
    thinker_cfg = _env(model_dir)[2].thinker_config
    hidden = thinker_cfg.text_config.hidden_size
    voice = min(load_speakers(model_dir))
    ctx = SimpleNamespace(stage=SimpleNamespace(model=model_dir), dtype=torch.float32)
    for name in ("audio_longer", "video_last", "two_videos"):
        content, videos, waves, images = _case(name)
        hf, ids, features = _prompt(model_dir, content, videos, waves, images)
        _, (thinker_pos, _) = _ours(model_dir, ids, features)
        out_ids = [100, 101, 102]
        payload = StagePayload(request_id="r", source_stage=0, prompt_token_ids=ids, output_token_ids=out_ids,
                               tensors={"hidden": torch.randn(len(ids) + 2, hidden), "mrope_positions": thinker_pos})
        out = processors.get("qwen2_5_omni.thinker_to_talker")({0: payload}, ctx, {"voice": voice})
        talker_ids = torch.tensor([ids + [load_speakers(model_dir)[voice].bos_token, out_ids[0]]])
        want, _ = _hf_rope(model_dir, hf, True, talker=True, ids=talker_ids)
        assert torch.equal(out.positions, want.long()), name


@lru_cache(maxsize=None)
def _hf_qwen3(model_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_qwen3_talker_kwargs(model_dir, hf, voice):
    """(thinker result, the kwargs transformers' generate hands talker.generate) for these inputs."""
    return reference.talker_call(_hf_qwen3(model_dir), hf, use_audio_in_video=True, speaker=voice,
                                 thinker_max_new_tokens=4, thinker_do_sample=False, talker_max_new_tokens=2)


def test_qwen3_talker_gets_plain_positions_as_transformers_does(tiny_models):
    """transformers' generate does not pass `use_audio_in_video` to the Qwen3 talker: its rope index
    (run here as its forward runs it, on the kwargs generate built) numbers the audio-in-video prompt
    0, 1, 2, ... Our processor, given our thinker's positions, says the same, and its prompt rows
    (the video's and the audio's pads are media rows) equal the reference's."""
    model_dir = str(tiny_models[Q3])
    content, videos, waves, images = _case("two_videos")
    hf, ids, features = _prompt(model_dir, content, videos, waves, images)
    _, (thinker_pos, _) = _ours(model_dir, ids, features)
    result, ref = _hf_qwen3_talker_kwargs(model_dir, dict(hf), "Ethan")
    layer = _hf_qwen3(model_dir).config.talker_config.accept_hidden_layer
    seq = result.sequences[0].tolist()
    payload = StagePayload(request_id="r", source_stage=0, prompt_token_ids=ids, output_token_ids=seq[len(ids):],
                           tensors={"hidden": torch.cat([s[layer] for s in result.hidden_states], dim=1)[0],
                                    "mrope_positions": thinker_pos})
    ctx = SimpleNamespace(stage=SimpleNamespace(model=model_dir), dtype=torch.float32)
    out = processors.get("qwen3_omni_moe.thinker_to_talker")({0: payload}, ctx, {"voice": "Ethan"})
    assert ref.get("use_audio_in_video") is None  # (the reference's talker is not told)
    ref = ref | {"feature_attention_mask": hf["feature_attention_mask"]}
    with pytest.raises(AttributeError, match="audio_config"):  # (what transformers' own talker forward does)
        _hf_rope(model_dir, ref, False, talker=True, ids=ref["talker_input_ids"], talker_audio_config=False)
    want, _ = _hf_rope(model_dir, ref, False, talker=True, ids=ref["talker_input_ids"])
    n = want.shape[1]
    assert torch.equal(want.long(), torch.arange(n).expand(3, -1))
    assert torch.equal(out.positions, want.long())
    torch.testing.assert_close(out.prompt["prompt_embeds"], ref["inputs_embeds"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("image", ["first", "between", None])
def test_qwen3_talker_positions_with_an_image_equal_transformers(tiny_models, image):
    """With an image, transformers' Qwen3 talker (flag off) still takes a span whole while an image is
    left after it, and reads spans after the last image as plain audio (function level: the talker's
    get_rope_index over the user turns + 9 assistant rows, which are text to it). Without one (here
    after a system turn and an earlier exchange, which the talker never sees): 0, 1, 2, ..."""
    from omni_server.models.qwen3_omni_moe.processors import _user_positions, talker_positions

    model_dir = str(tiny_models[Q3])
    cfg = _env(model_dir)[2]
    at = [{"type": "image"}]
    content = [{"type": "text", "text": "See"}, *(at if image == "first" else []), {"type": "video"},
               {"type": "text", "text": "then"}, *(at if image == "between" else []), {"type": "video"},
               {"type": "text", "text": "?"}]
    videos, waves = [_frames(4, seed=1), _frames(6, seed=2)], [_wave(2.6), _wave(1.2, seed=2)]
    hf, ids, features = _prompt(model_dir, content, videos, waves, [_image()] if image else [],
                                history=() if image else HISTORY)
    thinker_pos = _check_thinker(model_dir, hf, ids, features)
    t = torch.tensor(ids)
    user = _user_positions(t, cfg.im_start_token_id, cfg.user_token_id)
    got = talker_positions(thinker_pos, user, 9, t[user], (cfg.thinker_config.vision_start_token_id,
                                                           cfg.thinker_config.audio_start_token_id,
                                                           cfg.thinker_config.image_token_id))
    talker_ids = torch.cat([t[user], torch.full((9,), 300)])[None]  # (assistant rows: text to the rope index)
    want, _ = _hf_rope(model_dir, hf, False, talker=True, ids=talker_ids)
    assert torch.equal(got, want.long())
    assert torch.equal(got, torch.arange(got.shape[1]).expand(3, -1)) == (image is None)  # (an image keeps its grid)
