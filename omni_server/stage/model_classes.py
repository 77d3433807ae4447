"""Our own vLLM model classes, chosen per stage by name (`model_class: family.name` in the YAML).

A checkpoint such as Qwen2.5-Omni holds several models in one directory and one config.json; a stage
serving one of them (the talker) gives vLLM that sub-model's config through `hf_overrides` (a
callable, vLLM's extension point for config rewrites) and registers the class in vLLM's
ModelRegistry by a lazy "module:Class" reference. No vLLM code is patched.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class ModelClass:
    # Architecture name registered in vLLM's ModelRegistry (unique to omni-server).
    architecture: str
    # "package.module:Class" of the vLLM model implementation (imported by vLLM when needed).
    target: str
    # Attribute of the checkpoint's HF config that configures this model (None: the config itself).
    sub_config: str | None = None
    # EngineArgs defaults for stages serving this model (the YAML's engine_args win).
    engine_defaults: dict[str, Any] = field(default_factory=dict)
    # Adjusts the selected config in place (a module-level function, so it pickles).
    adapt_config: Callable[[Any], None] | None = None


_REGISTRY: dict[str, ModelClass] = {}


def register(name: str, model_class: ModelClass) -> None:
    if _REGISTRY.get(name, model_class) != model_class:
        raise ValueError(f"model class {name!r} registered twice")
    _REGISTRY[name] = model_class


def get(name: str) -> ModelClass:
    if name not in _REGISTRY:
        from omni_server.models import import_family

        import_family(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        from omni_server.models import all_names

        raise KeyError(f"unknown model class {name!r}; known: {all_names(_REGISTRY)}") from None


def register_with_vllm() -> None:
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for mc in _REGISTRY.values():
        if mc.architecture not in known:
            ModelRegistry.register_model(mc.architecture, mc.target)


def _select(config: Any, sub_config: str | None, architecture: str, adapt: Callable[[Any], None] | None) -> Any:
    if sub_config and not hasattr(config, sub_config):
        return config  # vLLM probes the callable with a dummy config (to learn the model_type)
    chosen = getattr(config, sub_config) if sub_config else config
    chosen.architectures = [architecture]
    if adapt is not None:
        adapt(chosen)
    return chosen


def hf_overrides(mc: ModelClass):
    """The `hf_overrides` callable for EngineArgs (a partial of a module function: it must pickle
    into vLLM's worker processes)."""
    return functools.partial(_select, sub_config=mc.sub_config, architecture=mc.architecture,
                             adapt=mc.adapt_config)
