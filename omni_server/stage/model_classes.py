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
    # The mm_processor_kwargs that make its processor interleave each of a prompt's n videos with
    # its audio track (the prompt's n audio inputs, in video order); None: it cannot.
    audio_in_video: Callable[[int], dict[str, Any]] | None = None
    # The prompt tokens a video takes in its processor, (hf_processor, processor kwargs, frames,
    # height, width) -> count (None: not known), so a prompt whose videos cannot fit the context is
    # refused before the processor reads their frames; None: only vLLM's check, after processing.
    video_tokens: Callable[[Any, dict[str, Any], int, int, int], int | None] | None = None


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
    _register_online_fp8()


# `engine_args.quantization` on a sub-model stage. vLLM 0.26 quantizes weights at load only when
# `hf_overrides` is a dict (get_quant_config refuses the callable form a sub-model needs), but it
# reads a checkpoint's own `quantization_config` before that check. So the selected sub-config
# names this method there, as a quantized checkpoint would, and the method is vLLM's FP8 config
# with unquantized (bf16) weights: quantized at load, activations scaled per step (dynamic).
ONLINE_FP8 = "omni_server_online_fp8"
SUB_MODEL_QUANTIZATION = {"fp8": ONLINE_FP8}


def _register_online_fp8() -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    if ONLINE_FP8 in QUANTIZATION_METHODS:
        return

    class SubModelOnlineFp8(Fp8Config):
        @classmethod
        def get_name(cls):
            return ONLINE_FP8

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> "SubModelOnlineFp8":
            return cls(is_checkpoint_fp8_serialized=False, activation_scheme="dynamic")

    register_quantization_config(ONLINE_FP8)(SubModelOnlineFp8)


def _select(config: Any, sub_config: str | None, architecture: str, adapt: Callable[[Any], None] | None,
            quantization: str | None = None) -> Any:
    if sub_config and not hasattr(config, sub_config):
        return config  # vLLM probes the callable with a dummy config (to learn the model_type)
    chosen = getattr(config, sub_config) if sub_config else config
    chosen.architectures = [architecture]
    if adapt is not None:
        adapt(chosen)
    if quantization:
        chosen.quantization_config = {"quant_method": SUB_MODEL_QUANTIZATION[quantization]}
    return chosen


def sub_model(mc: ModelClass) -> bool:
    """Whether the class serves a part of its checkpoint (or a config it rewrites): vLLM then gets
    the config through a callable `hf_overrides`, and takes only SUB_MODEL_QUANTIZATION's methods."""
    return mc.sub_config is not None or mc.adapt_config is not None


def quantization_problem(mc: ModelClass, engine_args: dict[str, Any]) -> str | None:
    """Why a stage of this class cannot be quantized as `engine_args` ask (None: it can)."""
    if not sub_model(mc):
        return None
    if "quantization_config" in engine_args:
        # (vLLM reads one only with a dict `hf_overrides`: the engine would fail at start naming neither)
        return ("`engine_args.quantization_config` cannot apply to a sub-model of the checkpoint; "
                "`quantization: fp8` quantizes its weights at load")
    method = engine_args.get("quantization")
    if method not in (None, *SUB_MODEL_QUANTIZATION):
        return (f"`engine_args.quantization: {method}`: a sub-model of the checkpoint takes only "
                f"{', '.join(SUB_MODEL_QUANTIZATION)} (its weights quantized at load)")
    return None


def engine_overrides(mc: ModelClass, args: dict[str, Any]) -> dict[str, Any]:
    """EngineArgs `args` for a stage of this class: its defaults under them, and `hf_overrides`
    naming its architecture (a whole checkpoint's: a dict, so vLLM reads the checkpoint's own
    quantization, or any the YAML names)."""
    args = {**mc.engine_defaults, **args}
    if not sub_model(mc):  # (with the YAML's own overrides, if any)
        given = args.get("hf_overrides")
        return {**args, "hf_overrides": {**(given if isinstance(given, dict) else {}), "architectures": [mc.architecture]}}
    # (a sub-model is quantized through its config: ONLINE_FP8)
    overrides = hf_overrides(mc, args.pop("quantization", None))
    return {**args, "hf_overrides": overrides}


def hf_overrides(mc: ModelClass, quantization: str | None = None):
    """The `hf_overrides` callable for EngineArgs (a partial of a module function: it must pickle
    into vLLM's worker processes); `quantization` a SUB_MODEL_QUANTIZATION key."""
    return functools.partial(_select, sub_config=mc.sub_config, architecture=mc.architecture,
                             adapt=mc.adapt_config, quantization=quantization)
