"""Reading a (possibly sharded) safetensors checkpoint that holds several models (Qwen-Omni's
thinker, talker, vocoder...) one sub-model at a time."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(model_dir: str):
    """The checkpoint's transformers config (e.g. `Qwen2_5OmniConfig`)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def load_tensors(model_dir: str, prefix: str) -> dict[str, torch.Tensor]:
    """CPU tensors whose names start with `prefix`, keyed by the rest of the name.

    With a sharded checkpoint only the shards holding such tensors are opened, so loading e.g. the
    token2wav of a 7B checkpoint does not touch the thinker's shards.
    """
    root = Path(model_dir)
    if (root / SINGLE_FILE).is_file():
        shards: dict[str, list[str] | None] = {SINGLE_FILE: None}  # None: filter while reading
    elif (root / INDEX_FILE).is_file():
        weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        shards = defaultdict(list)
        for name, shard in weight_map.items():
            if name.startswith(prefix):
                shards[shard].append(name)
    else:
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")

    tensors = {}
    for shard, names in shards.items():
        with safe_open(root / shard, framework="pt", device="cpu") as f:
            for name in names if names is not None else f.keys():
                if name.startswith(prefix):
                    tensors[name[len(prefix):]] = f.get_tensor(name)
    return tensors


def load_module(cls, config, model_dir: str, prefix: str, device: torch.device) -> torch.nn.Module:
    """transformers' `cls` built from `config` with the checkpoint's `prefix.*` weights, float32, in
    eval mode on `device`. Every parameter comes from the checkpoint: the random init is skipped
    (slow for real sizes) and the global RNG left alone; missing or extra weights are an error."""
    from transformers.initialization import no_init_weights

    with torch.random.fork_rng(devices=[]), no_init_weights():
        model = cls._from_config(config, attn_implementation="sdpa")
    result = model.load_state_dict(load_tensors(model_dir, prefix), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"{prefix.rstrip('.')} weights in {model_dir} do not match the model: "
                         f"missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    # float32: these vocoders are trained / validated in float32 (transformers forces it too).
    return model.float().eval().to(device)


def cast_keeping_rotary(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module.to(dtype)`, but its rotary frequency buffers (`*inv_freq`) keep their float32 values,
    as transformers' own half-precision load keeps them: rounded to bf16 they are ~0.4% off, which
    turns every position's angle (a greedy Qwen3 code predictor frame in 4 changed)."""
    kept = {name: buf for name, buf in module.named_buffers() if name.endswith("inv_freq")}
    module.to(dtype)
    for name, buf in kept.items():
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, buf)
    return module
