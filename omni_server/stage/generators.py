"""Generators: the torch modules that generation (non-AR) stages run, by registered name.

A generator is a class `Gen(model_dir, device, **generator_args)` with `sample_rate`, `voices` and
`batch([{**inputs, "voice": ..., "seed": ...}, ...]) -> [1-D float32 waveform | ValueError, ...]`,
one pass over several requests, where `inputs` come from the stage's input processor
(StageInput.data), `voice` from the request (None: the default voice) and `seed` from its sampling
settings (None: random); an invalid request gets its ValueError in its place (a RequestError when
the request's own option is at fault, e.g. its voice). A token input is
named `codes` (a vocoder's codec codes): the stage reports its length as the tokens the request's
audio was made from (`usage.output_tokens` of /v1/audio/speech).

Generators that take streamed input (`input_mode: stream`) also have `open_stream(voice, seed)`
-> a stream with `feed(final=..., **inputs)` (everything so far), `done` and `consumed` (input
tokens no later step reads: the upstream may run `stream_window` ahead of it); `stream_ready(stream)`;
`stream_step([stream, ...]) -> [new waveform piece | ValueError, ...]`; and optionally `stream_lead`,
the input tokens beyond `consumed` a stream needs before its next step (at most `stream_window`),
and `stream_batch_sizes`, the pass sizes a `stream_step` runs without padding (the stage prefers
the largest that fits; stream_order.py; a stream that only flushes audio still counts as one).

Families register a lazy "module:Class" reference, so the module loads only in the stage that runs it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util

_REGISTRY: dict[str, str] = {}


from omni_server.stage.errors import RequestError  # noqa: F401  (part of the generator contract)


def register(name: str, target: str) -> None:
    if _REGISTRY.get(name, target) != target:
        raise ValueError(f"generator {name!r} registered twice")
    _REGISTRY[name] = target


def target(name: str) -> str:
    """"module:Class" registered as `name` (imports its family, not the module: cheap, for checks)."""
    if name not in _REGISTRY:
        from omni_server.models import import_family

        import_family(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        from omni_server.models import all_names

        raise KeyError(f"unknown generator {name!r}; known: {all_names(_REGISTRY)}") from None


def arguments(name: str) -> tuple[set[str], bool] | None:
    """The keyword arguments the generator registered as `name` takes besides `model_dir` and
    `device`, and whether it takes any (**kwargs), read from its module's source (nothing is
    imported); None when the source cannot be read."""
    module, cls = target(name).split(":")
    try:
        spec = importlib.util.find_spec(module)
        tree = ast.parse(open(spec.origin).read()) if spec and spec.origin else None
    except (ImportError, OSError, SyntaxError, ValueError):
        return None
    for node in tree.body if tree else ():
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    a = item.args  # (self, model_dir, device, ...)
                    return {x.arg for x in a.args[3:] + a.kwonlyargs}, a.kwarg is not None
    return None


def load(name: str):
    """The generator class registered as `name` (imports its family, then its module)."""
    module, cls = target(name).split(":")
    return getattr(importlib.import_module(module), cls)
