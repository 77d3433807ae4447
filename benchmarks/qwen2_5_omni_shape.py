"""Write a checkpoint directory shaped like Qwen/Qwen2.5-Omni-7B (or -3B) for offline benchmarks.

    python benchmarks/qwen2_5_omni_shape.py --out /tmp/qwen2_5-omni-7b-shape [--size 7b|3b] [--device cuda]

The benchmark GPU host has no network, so the real ~22 GB checkpoint cannot be fetched.  This writes
the real architecture (config.json with the published Qwen2.5-Omni values, see the sources below) and
random weights only for what our own code reads from the checkpoint itself:

* ``thinker.model.embed_tokens.weight`` (bf16): the thinker -> talker input processor projects it,
* ``talker.thinker_to_talker_proj.{weight,bias}`` and ``talker.model.embed_tokens.weight`` (bf16):
  same processor (``omni_server/models/qwen2_5_omni/processors.py::_tables``),
* every ``token2wav.*`` tensor (float32): ``omni_server/models/qwen2_5_omni/token2wav.py`` loads them
  into transformers' ``Qwen2_5OmniToken2WavModel`` (strictly: no key may be missing or unexpected).

The vLLM stages (thinker, talker) must run with ``load_format: dummy``, e.g.
``--stage-arg thinker.load_format=dummy --stage-arg talker.load_format=dummy``; their weights are not
in this directory.  ``spk_dict.pt`` holds random "Chelsie" and "Ethan" voices in transformers' layout.

Tokenizer, chat template, processor and generation config are copied from the tiny checkpoint
(``var/models/tiny-qwen2_5-omni``, built on demand by ``omni_server.models.tiny_checkpoints``).  Its
vocabulary's 1024 plain ids are a prefix of the real 152k-id table, so text prompts tokenize to valid
ids; its special tokens (``<|im_start|>``, the media placeholders ``<|AUDIO|>``, ``<|IMAGE|>``, ...)
move to their real ids (``move_specials``: 151643 on, as config.json names them), so image, audio
and video prompts reach the thinker's (dummy-weight) encoders at their real shapes; every other id
below the vocabulary size gets a filler token (``fill_vocab``). The image processor takes the
published pixel bounds (``real_image_size``: up to 12.8 MP) instead of the tiny one's 0.1 MP.

Weights are seeded (``--seed``); the same seed on the same device type writes the same tensors.
Output: 2.95 GB for 7B (1.09 GB thinker embeddings + 0.06 GB talker tables + 1.80 GB float32
token2wav, 449M parameters), 2.46 GB for 3B; sharded with ``model.safetensors.index.json`` above
``--max-shard-gb`` (2 shards for both at the 2 GiB default).  About 30 s on 2 CPU cores.

Where the config values come from (all public; repository paths as indexed by the code search):

* 7B config, checked field by field against the published config.json at HF revision
  ae9e1690543ffd5c0221dc27f79834d0294cba00: ``ayutaz/vokra`` ``tools/parity/qwen2_5_omni_7b_inspect.py``
  (``validate_config``): thinker text 3584 hidden / 28 layers / 28 heads / 4 kv / vocab 152064;
  audio d_model 1280 / 32 layers / 20 heads / 128 mels / output_dim 3584; vision depth 32 /
  hidden 1280 / 16 heads / out 3584 / patch 14 / temporal patch 2 / window 112; talker hidden 896 /
  24 layers / 12 heads / 4 kv / vocab 8448; DiT dim 1024 / depth 22 / heads 16 / num_embeds 8193;
  BigVGAN mel_dim 80 / upsample_initial_channel 1536 / upsample_rates [5, 3, 2, 2, 2, 2].
* 7B talker head_dim 128, intermediate 18944, embedding_size 3584: config.json of fine-tunes that
  keep the original talker block ("_name_or_path": "Qwen2.5-Omni-7B/talker"), e.g. huggingface.co
  ACE-Step/acestep-captioner and Duofu/EmotionThinker; the same 896/12/4/24/18944/3584 in rtp-llm's
  ``test_talker.py`` (``Qwen2_5OmniTalker._create_config`` test).
* 3B: ``lluda_inference`` ``config.rs`` doc comments "For Qwen2.5-Omni-3B" (read from the real
  config.json): text 2048 hidden / 11008 intermediate / 36 layers / 16 heads / 2 kv / vocab 151936,
  untied; audio output_dim 2048; talker 896 hidden / 4864 intermediate / 24 layers / 14 heads /
  2 kv / head_dim 64 / vocab 8448 / embedding_size 2048; codec ids 8292 / 8293 / 8294.
* DiT internals: nntrainer ``token2wav_dit_converter.py`` (hidden 1024, depth 22, 16 heads x 64,
  ff inner 2048 = ff_mult 2, mel 80, codec table 8194 x 512 = (num_embeds + 1) x emb_dim,
  ECAPA enc_dim 128 -> enc_emb_dim 192, repeats 2, block_size 24, rope theta 10000).
* Voices: vLLM-Omni ``vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py``
  (``tts_text_spk_token_ids``: Ethan / m02 = 151870, Chelsie / f030 = 151872).
* mrope_section [16, 24, 24]: NeMo Megatron-Bridge ``Qwen25OmniModelProvider`` docs.
* Everything else (token ids, tts_* ids, rope theta 1e6, rms eps, DiT look-ahead / look-back
  layers, ECAPA channels, BigVGAN kernel sizes and dilations, vision intermediate 3420 and
  full-attention blocks, audio n_window) is transformers' ``configuration_qwen2_5_omni`` default,
  which transformers documents as the Qwen2.5-Omni-7B values; not independently verified.
* Derived, not found published: the 3B vision tower is the 7B one with out_hidden_size 2048 (it must
  equal the text hidden size); the 3B talker mrope_section is [8, 12, 12] (must sum to head_dim / 2
  = 32 for transformers' talker; our vLLM talker ignores it); the 3B DiT / BigVGAN / voices are the
  7B ones; ``ref_mel`` length 300 frames (the real spk_dict.pt is 259,544 bytes, i.e. roughly
  400 float32 frames per voice; the length only sets the speaker encoder's input).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TINY = REPO_ROOT / "var" / "models" / "tiny-qwen2_5-omni"

# Files taken verbatim from the tiny checkpoint: everything except its weights, config and voices.
_NOT_COPIED = {"config.json", "model.safetensors", "model.safetensors.index.json", "spk_dict.pt"}

VOICES = {"Chelsie": 151872, "Ethan": 151870}  # name -> thinker token opening the talker's text stream
REF_MEL_FRAMES = 300

# Token ids of the real Qwen2 vocabulary (transformers defaults = the 7B/3B config.json values).
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
MEDIA_IDS = {
    "audio_token_index": 151646,
    "image_token_index": 151655,
    "video_token_index": 151656,
    "audio_start_token_id": 151647,
    "audio_end_token_id": 151648,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}

SIZES = {
    "7b": {
        "text": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4},
        "talker": {"hidden_size": 896, "intermediate_size": 18944, "num_hidden_layers": 24,
                   "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 128,
                   "mrope_section": [16, 24, 24]},
    },
    "3b": {
        "text": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
                 "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2},
        "talker": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
                   "mrope_section": [8, 12, 12]},
    },
}


def config_dicts(size: str) -> dict:
    """thinker_config / talker_config / token2wav_config for `size`, as Qwen2_5OmniConfig kwargs."""
    s = SIZES[size]
    text, talker = s["text"], dict(s["talker"])
    hidden = text["hidden_size"]
    text_config = {
        **text,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
        "pad_token_id": ENDOFTEXT,
        "dtype": "bfloat16",
    }
    audio_config = {
        "num_mel_bins": 128, "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120, "max_source_positions": 1500, "n_window": 100, "output_dim": hidden,
        "activation_function": "gelu", "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "scale_embedding": False,
    }
    vision_config = {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "hidden_act": "silu",
        "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "out_hidden_size": hidden,
        "tokens_per_second": 25,
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        **MEDIA_IDS,
        "vision_token_id": 151654,
        "bos_token_id": IM_START,
        "eos_token_id": IM_END,
        "pad_token_id": ENDOFTEXT,
        "user_token_id": 872,
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    mrope = talker.pop("mrope_section")
    talker_config = {
        **talker,
        "vocab_size": 8448,
        "embedding_size": hidden,  # the talker reads thinker-space vectors
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "tts_codec_start_token_id": 8293,
        "tts_codec_end_token_id": 8294,
        "tts_codec_pad_token_id": 8292,
        "tts_codec_mask_token_id": 8296,
        "tts_text_start_token_id": 151860,
        "tts_text_end_token_id": 151861,
        "tts_text_pad_token_id": 151859,
        **MEDIA_IDS,
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "spatial_merge_size": 2,
        "dtype": "bfloat16",
    }
    # The published file spells the DiT sizes dim / depth / heads; transformers' names are used here.
    token2wav_config = {
        "dit_config": {
            "hidden_size": 1024, "num_hidden_layers": 22, "num_attention_heads": 16, "head_dim": 64,
            "ff_mult": 2, "emb_dim": 512, "mel_dim": 80, "num_embeds": 8193, "repeats": 2,
            "block_size": 24, "look_ahead_layers": [10], "look_backward_layers": [0, 20],
            "max_position_embeddings": 32768, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "dropout": 0.1, "enc_emb_dim": 192, "enc_dim": 128, "enc_channels": [256, 256, 256, 256, 768],
            "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 64, "enc_res2net_scale": 2, "enc_se_channels": 64,
        },
        "bigvgan_config": {
            "mel_dim": 80, "upsample_initial_channel": 1536, "resblock_kernel_sizes": [3, 7, 11],
            "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
            "upsample_rates": [5, 3, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
        },
    }
    return {"thinker_config": thinker_config, "talker_config": talker_config,
            "token2wav_config": token2wav_config}


def build_config(size: str):
    from transformers import Qwen2_5OmniConfig

    config = Qwen2_5OmniConfig(**config_dicts(size), enable_audio_output=True, enable_talker=True)
    config.architectures = ["Qwen2_5OmniModel"]  # as in the published config.json
    config.dtype = "bfloat16"
    return config


def speaker_dict(config, seed: int) -> dict:
    import torch

    dit = config.token2wav_config.dit_config
    generator = torch.Generator().manual_seed(seed)
    return {
        name: {
            "bos_token": bos,
            "cond": torch.randn(1, dit.enc_emb_dim, generator=generator),
            "ref_mel": torch.randn(1, REF_MEL_FRAMES, dit.mel_dim, generator=generator),
        }
        for name, bos in VOICES.items()
    }


def _normal(shape, std: float, device, generator):
    import torch

    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=generator).cpu()


def table_tensors(config, device, seed: int, std: float = 0.02) -> dict:
    """The bf16 tables the thinker -> talker processor reads; everything else of thinker/talker is dummy."""
    import torch

    text, talker = config.thinker_config.text_config, config.talker_config
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        "thinker.model.embed_tokens.weight": _normal((text.vocab_size, text.hidden_size), std, device, g),
        "talker.thinker_to_talker_proj.weight": _normal((talker.hidden_size, talker.embedding_size), std, device, g),
        "talker.thinker_to_talker_proj.bias": _normal((talker.hidden_size,), std, device, g),
        "talker.model.embed_tokens.weight": _normal((talker.vocab_size, talker.embedding_size), std, device, g),
    }


def token2wav_tensors(config, device, seed: int, std: float) -> dict:
    """Every state-dict tensor of a randomly initialised Qwen2_5OmniToken2WavModel, float32 on CPU."""
    import torch
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    # Only the init reads initializer_range: the saved config is untouched, the state-dict keys and
    # shapes are those of the real model (transformers' own init also sets the resampling filters).
    init_config = copy.deepcopy(config.token2wav_config)
    for c in (init_config, init_config.dit_config, init_config.bigvgan_config):  # each sub-model inits itself
        c.initializer_range = std
    dev = torch.device(device)
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2_5OmniToken2WavModel._from_config(init_config, attn_implementation="sdpa").float()
    # clone(): no storage sharing, which safetensors refuses.
    tensors = {f"token2wav.{k}": v.detach().to("cpu", torch.float32).clone().contiguous()
               for k, v in model.state_dict().items()}
    del model
    return tensors


def write_safetensors(out: Path, tensors: dict, max_shard_bytes: int) -> list[Path]:
    """model.safetensors, or model-0000k-of-0000n.safetensors + index above `max_shard_bytes`."""
    from safetensors.torch import save_file

    nbytes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(nbytes.values())
    if total <= max_shard_bytes:
        path = out / "model.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        return [path]
    shards: list[list[str]] = [[]]
    size = 0
    for name in tensors:  # insertion order keeps each sub-model's tensors together
        if shards[-1] and size + nbytes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    paths, weight_map = [], {}
    for i, names in enumerate(shards, 1):
        path = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(path), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, path.name))
        paths.append(path)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths


def copy_tiny_files(tiny: Path, out: Path) -> list[str]:
    if not (tiny / "tokenizer.json").is_file():
        from omni_server.models.tiny_checkpoints import ensure_all

        ensure_all(tiny.parent)
    copied = []
    for f in sorted(tiny.iterdir()):
        if f.is_file() and f.name not in _NOT_COPIED and not f.name.startswith("."):
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    return copied


# Special tokens whose ids config.json names (the thinker's): placeholder and bracket tokens.
_CONFIG_SPECIALS = {"audio_token_index": "<|AUDIO|>", "image_token_index": "<|IMAGE|>",
                    "video_token_index": "<|VIDEO|>", "audio_start_token_id": "<|audio_bos|>",
                    "audio_end_token_id": "<|audio_eos|>", "vision_start_token_id": "<|vision_bos|>",
                    "vision_end_token_id": "<|vision_eos|>"}


def move_specials(out: Path, thinker_config) -> int:
    """Move the tiny tokenizer's special tokens by one shift, so that those config.json names take its
    ids (`<|AUDIO|>` 151646, ...: checked) and media prompts reach the thinker's placeholders. The
    tiny table lists the chat and media specials in the real order, from 1024 instead of 151643; the
    tts ones land elsewhere than config.json's tts ids, which no prompt tokenizes. Rewrites
    tokenizer.json and generation_config.json; returns the shift."""
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    added = {t["content"]: t["id"] for t in data["added_tokens"]}
    shift = thinker_config.audio_token_index - added["<|AUDIO|>"]
    for key, token in _CONFIG_SPECIALS.items():
        if added.get(token, -1) + shift != getattr(thinker_config, key):
            raise SystemExit(f"{token}: the tiny tokenizer's order differs from the real one ({key})")
    vocab = data["model"]["vocab"]
    for t in data["added_tokens"]:
        if vocab.get(t["content"]) == t["id"]:
            vocab[t["content"]] = t["id"] + shift
        t["id"] += shift
    path.write_text(json.dumps(data, ensure_ascii=False))
    gen = out / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(g.get(key), int) and g[key] in added.values():
                g[key] += shift
        gen.write_text(json.dumps(g, indent=2) + "\n")
    return shift


# The published image processor's pixel bounds (Qwen2-VL's preprocessor_config.json values, which
# Qwen2.5-Omni's repeats): the tiny checkpoint caps images at 100,352 pixels (128 tokens) to stay fast.
IMAGE_PIXELS = {"shortest_edge": 3136, "longest_edge": 12845056}


def real_image_size(out: Path) -> None:
    """Images as big as the real processor lets them (a 1280x720 picture: 1,196 thinker tokens)."""
    path = out / "processor_config.json"
    data = json.loads(path.read_text())
    data["image_processor"]["size"] = dict(IMAGE_PIXELS)
    path.write_text(json.dumps(data, indent=2) + "\n")


def fill_vocab(tokenizer_json: Path, vocab_size: int) -> int:
    """Give every id below `vocab_size` that the tiny tokenizer lacks a token of its own ("Ġw<id>",
    never produced by encoding: no merge leads to it), so that whatever a dummy-weight thinker
    samples decodes to text and the bench sees first tokens (TTFT). Returns how many were added."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    # tokenizers numbers added (special) tokens from the end of the model's vocab on load: with ids
    # past them in the model, they would move. Listed in the model too, they keep their ids.
    for t in data.get("added_tokens", ()):
        vocab.setdefault(t["content"], t["id"])
    taken = set(vocab.values())
    names = set(vocab)
    added = 0
    for i in range(vocab_size):
        if i not in taken:
            name = f"\u0120w{i}"
            while name in names:
                name += "x"
            vocab[name] = i
            names.add(name)
            added += 1
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))
    return added


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (created; must be empty)")
    parser.add_argument("--size", choices=sorted(SIZES), default="7b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the random weights are drawn (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--init-std", type=float, default=0.02,
                        help="std of the token2wav weights (transformers' default init); default %(default)s")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="shard above this many GiB")
    parser.add_argument("--tiny", type=Path, default=DEFAULT_TINY,
                        help="tiny checkpoint to copy tokenizer/processor files from (built if missing)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # e.g. "tts_text_start_token_id outside the vocabulary": real config too
    out: Path = args.out
    if out.exists() and any(out.iterdir()) and not args.force:
        sys.exit(f"{out} is not empty (use --force)")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    config = build_config(args.size)
    config.save_pretrained(out)
    copied = copy_tiny_files(args.tiny, out)
    move_specials(out, config.thinker_config)
    real_image_size(out)
    fill_vocab(out / "tokenizer.json", config.thinker_config.text_config.vocab_size)
    torch.save(speaker_dict(config, args.seed), out / "spk_dict.pt")

    t = time.perf_counter()
    tensors = table_tensors(config, args.device, args.seed)
    t_tables = time.perf_counter() - t
    t = time.perf_counter()
    tensors.update(token2wav_tensors(config, args.device, args.seed + 1, args.init_std))
    t_t2w = time.perf_counter() - t
    t = time.perf_counter()
    shards = write_safetensors(out, tensors, int(args.max_shard_gb * 2**30))
    t_write = time.perf_counter() - t

    n_t2w = sum(v.numel() for k, v in tensors.items() if k.startswith("token2wav."))
    (out / "SHAPE_CHECKPOINT.json").write_text(json.dumps({
        "note": "synthetic: real Qwen2.5-Omni config, random weights; serve thinker/talker with load_format=dummy",
        "size": args.size, "seed": args.seed, "device": args.device, "init_std": args.init_std,
        "written_by": "benchmarks/qwen2_5_omni_shape.py", "copied_from_tiny": copied,
    }, indent=2) + "\n")
    for f in out.iterdir():  # the safetensors writer creates owner-only files; nothing here is private
        f.chmod(0o644)
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(json.dumps({
        "out": str(out), "size": args.size, "device": args.device,
        "tensors": len(tensors), "token2wav_params": n_t2w,
        "shards": [p.name for p in shards], "bytes": total,
        "seconds": {"tables": round(t_tables, 1), "token2wav": round(t_t2w, 1), "write": round(t_write, 1),
                    "total": round(time.perf_counter() - t0, 1)},
    }))


if __name__ == "__main__":
    main()
