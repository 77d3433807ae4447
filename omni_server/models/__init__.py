"""Model families: everything model-specific, plugged into stages by name from the YAML.

A family `omni_server.models.<family>` registers on import its stage input processors, its vLLM model
classes (`model_class:` in the YAML) and its generators (`generator:`). Generic code imports a family
only through a `family.thing` name, or all of them through `register_vllm_models()`.
"""

from __future__ import annotations

import importlib

# Families with vLLM model classes; imported in every vLLM worker process so vLLM can resolve them.
FAMILIES = ("qwen2_5_omni", "qwen3_omni_moe")


def import_family(name: str) -> None:
    """Import the family a registered `family.thing` name belongs to (it registers on import)."""
    if "." in name:
        importlib.import_module(f"omni_server.models.{name.split('.', 1)[0]}")


def all_names(registry: dict) -> list[str]:
    """A registry's names once every family registered its own (for an unknown name's error: a
    lookup imports only the family its name starts with)."""
    for family in FAMILIES:
        importlib.import_module(f"omni_server.models.{family}")
    return sorted(registry)


def register_vllm_models() -> None:
    """Make every family's vLLM model classes known to vLLM's ModelRegistry in this process."""
    from omni_server.stage import model_classes

    for family in FAMILIES:
        importlib.import_module(f"omni_server.models.{family}")
    model_classes.register_with_vllm()


def reference_for(model_dir: str):
    """The transformers reference pipeline class of the family that `model_dir` (a checkpoint)
    belongs to: `omni_server.models.<config.json model_type>.reference.Reference`."""
    import json
    from pathlib import Path

    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "")
    name = f"omni_server.models.{model_type}.reference"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in (name, name.rsplit(".", 1)[0]):
            raise
        raise ValueError(f"no reference pipeline for model_type {model_type!r} ({model_dir})") from None
    return module.Reference
