"""Write a checkpoint directory shaped like Qwen/Qwen3-Omni-30B-A3B-Instruct for offline benchmarks.

    python benchmarks/qwen3_omni_shape.py --out /tmp/qwen3-omni-shape [--device cuda]

Like `qwen2_5_omni_shape.py` (whose helpers it uses): the real architecture in config.json and random
weights only for what our own code reads from the checkpoint itself; the vLLM stages (thinker,
talker decoder) run with ``load_format: dummy``:

* ``thinker.model.embed_tokens.weight``, ``talker.{text,hidden}_projection.*`` and
  ``talker.model.codec_embedding.weight``: the thinker -> talker input processor
  (``omni_server/models/qwen3_omni_moe/processors.py::_tables``),
* every ``talker.code_predictor.*`` tensor: the talker builds its code predictor from them
  (``code_predictor.py``),
* every ``code2wav.*`` tensor: the code2wav stage (``code2wav.py``).

All bf16, as the published checkpoint stores them. 1.35 GB, about a minute on 2 CPU cores.

Token ids: the tokenizer and chat template are the tiny checkpoint's (``var/models/tiny-qwen3-omni-moe``)
with every id below the real vocabulary size given a token (``fill_vocab``), and config.json carries
the tiny tokenizer's special ids (``<|im_start|>``, ``user``, ``assistant``, ``<tts_pad>``, media
placeholders, ...) instead of the real ones: the talker's input processor finds user turns and the
assistant segment by these ids, which must match what the tokenizer produces. Ids are not shapes;
every size below is the published one. Only text prompts are meaningful (the media towers are
dummy too). Codec ids and voices are the real ones.

Where the values come from (the published config.json as quoted by public code; checked against each
other, and the parameter count they give, 35,259,818,545, is the published total):
``swedishembedded/brain`` crates/omni/src/config.rs + docs/models/omni/status.md (values read from
the released config.json and index); ``Ascend/MindSpeed-MM``
tests/ut/models/transformers/qwen3omni/test_attention_modules.py (thinker text / audio / vision
configs); ``jd-opensource/xllm`` xllm/models/vlm/npu/qwen3_omni_moe_talker.h (talker text config);
``sgl-project/sglang-jax`` TestQwen3OmniMoePrecision (thinker text config); ``NVIDIA-NeMo/Megatron-Bridge``
tests/functional_tests/models/qwen_omni/test_qwen3_omni_moe_generation.py (codec ids, speakers, key
layout). docs/qwen3_omni.md lists the same talker values.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen2_5_omni_shape import copy_tiny_files, fill_vocab, write_safetensors  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TINY = REPO_ROOT / "var" / "models" / "tiny-qwen3-omni-moe"

THINKER_TEXT = {
    "vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                        "interleaved": True, "mrope_interleaved": True},
    "tie_word_embeddings": False, "hidden_act": "silu",
}
AUDIO = {
    "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
    "num_mel_bins": 128, "output_dim": 2048, "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500,
    "downsample_hidden_size": 480, "max_source_positions": 1500, "activation_function": "gelu",
}
VISION = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 2048,
    "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh", "image_size": 768,
    "in_channels": 3, "apply_vit_abs_pos_embed": True, "num_position_embeddings": 2304,
}
TALKER_TEXT = {
    "vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 384,
    "shared_expert_intermediate_size": 768, "num_hidden_layers": 20, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 6,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                        "interleaved": True},
}
CODE_PREDICTOR = {
    "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_code_groups": 16,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
CODE2WAV = {
    "codebook_size": 2048, "num_quantizers": 16, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "layer_scale_initial_scale": 0.01, "sliding_window": 72,
    "max_position_embeddings": 8000, "decoder_dim": 1536, "upsample_rates": [8, 5, 4, 3],
    "upsampling_ratios": [2, 2], "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
TALKER = {
    "thinker_hidden_size": 2048, "accept_hidden_layer": 24, "num_code_groups": 16, "spatial_merge_size": 2,
    "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
    "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
}
# Ids taken from the tiny checkpoint's config (see the module docstring), per config level.
_TOP_IDS = ("im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id",
            "system_token_id", "user_token_id", "assistant_token_id")
_MEDIA_IDS = ("audio_token_id", "image_token_id", "video_token_id", "vision_start_token_id",
              "audio_start_token_id")
_THINKER_IDS = _MEDIA_IDS + ("vision_end_token_id", "audio_end_token_id", "user_token_id")


def build_config(tiny: Path):
    from transformers import Qwen3OmniMoeConfig

    ids = json.loads((tiny / "config.json").read_text())
    thinker_ids, talker_ids = ids["thinker_config"], ids["talker_config"]
    text = {**THINKER_TEXT, "bos_token_id": thinker_ids["text_config"].get("bos_token_id"),
            "eos_token_id": thinker_ids["text_config"].get("eos_token_id"),
            "pad_token_id": thinker_ids["text_config"].get("pad_token_id")}
    thinker = {"text_config": text, "audio_config": AUDIO, "vision_config": VISION,
               **{k: thinker_ids[k] for k in _THINKER_IDS}, "position_id_per_seconds": 13,
               "seconds_per_chunk": 2, "tie_word_embeddings": False}
    talker = {"text_config": TALKER_TEXT, "code_predictor_config": CODE_PREDICTOR, **TALKER,
              **{k: talker_ids[k] for k in _MEDIA_IDS}, "position_id_per_seconds": 13, "seconds_per_chunk": 2,
              "tie_word_embeddings": False}
    config = Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=CODE2WAV,
                                enable_audio_output=True, **{k: ids[k] for k in _TOP_IDS})
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    config.dtype = "bfloat16"
    return config


def _module_tensors(cls, config, prefix: str, device, seed: int, std: float) -> dict:
    """Every state-dict tensor of a randomly initialised transformers module, bf16 on CPU."""
    import torch

    init_config = copy.deepcopy(config)
    init_config.initializer_range = std  # (only the init reads it; the saved config is untouched)
    dev = torch.device(device)
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = cls._from_config(init_config, attn_implementation="sdpa")
    tensors = {prefix + k: v.detach().to("cpu", torch.bfloat16).clone().contiguous()
               for k, v in model.state_dict().items()}
    del model
    return tensors


def table_tensors(config, device, seed: int, std: float = 0.02) -> dict:
    """The bf16 tables the thinker -> talker processor reads (the talker decoder itself is dummy)."""
    import torch

    text, talker = config.thinker_config.text_config, config.talker_config
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=g).cpu()

    out = {"thinker.model.embed_tokens.weight": normal(text.vocab_size, text.hidden_size),
           "talker.model.codec_embedding.weight": normal(talker.text_config.vocab_size, talker.text_config.hidden_size)}
    # The reference's ResizeMLP: thinker hidden -> talker intermediate_size -> talker hidden.
    inner, hidden = talker.text_config.intermediate_size, talker.text_config.hidden_size
    for name in ("text_projection", "hidden_projection"):
        out[f"talker.{name}.linear_fc1.weight"] = normal(inner, talker.thinker_hidden_size)
        out[f"talker.{name}.linear_fc1.bias"] = normal(inner)
        out[f"talker.{name}.linear_fc2.weight"] = normal(hidden, inner)
        out[f"talker.{name}.linear_fc2.bias"] = normal(hidden)
    return out


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCode2Wav,
        Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
    )
    from transformers.utils import logging as hf_logging

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (created; must be empty)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the random weights are drawn (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="shard above this many GiB")
    parser.add_argument("--tiny", type=Path, default=DEFAULT_TINY,
                        help="tiny checkpoint whose tokenizer files and special ids are used (built if missing)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)

    hf_logging.set_verbosity_error()
    out: Path = args.out
    if out.exists() and any(out.iterdir()) and not args.force:
        sys.exit(f"{out} is not empty (use --force)")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    copied = copy_tiny_files(args.tiny, out)  # (builds the tiny checkpoints first if missing)
    config = build_config(args.tiny)
    config.save_pretrained(out)
    fill_vocab(out / "tokenizer.json", config.thinker_config.text_config.vocab_size)

    tensors = table_tensors(config, args.device, args.seed)
    tensors.update(_module_tensors(Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
                                   config.talker_config.code_predictor_config, "talker.code_predictor.",
                                   args.device, args.seed + 1, args.init_std))
    tensors.update(_module_tensors(Qwen3OmniMoeCode2Wav, config.code2wav_config, "code2wav.",
                                   args.device, args.seed + 2, args.init_std))
    shards = write_safetensors(out, tensors, int(args.max_shard_gb * 2**30))
    (out / "SHAPE_CHECKPOINT.json").write_text(json.dumps({
        "note": "synthetic: real Qwen3-Omni-30B-A3B dimensions, the tiny tokenizer's special ids, random "
                "weights; serve thinker/talker with load_format=dummy",
        "seed": args.seed, "device": args.device, "init_std": args.init_std,
        "written_by": "benchmarks/qwen3_omni_shape.py", "copied_from_tiny": copied,
    }, indent=2) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)
    sizes = {p: sum(t.numel() for k, t in tensors.items() if k.startswith(p))
             for p in ("thinker.", "talker.code_predictor.", "code2wav.")}
    print(json.dumps({"out": str(out), "tensors": len(tensors), "params": sizes,
                      "shards": [p.name for p in shards],
                      "bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
