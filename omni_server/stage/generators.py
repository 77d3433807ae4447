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


def _init_args(name: str) -> ast.arguments | None:
    """The generator's `__init__` arguments as its module's source spells them (nothing is
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
                    return item.args
    return None


def arguments(name: str) -> tuple[set[str], bool] | None:
    """The keyword arguments the generator registered as `name` takes besides `model_dir` and
    `device`, and whether it takes any (**kwargs); None when its source cannot be read."""
    a = _init_args(name)
    if a is None:
        return None
    return {x.arg for x in a.args[3:] + a.kwonlyargs}, a.kwarg is not None


def argument_problems(name: str, args: dict) -> list[str]:
    """`generator_args` values that do not fit their parameter's annotation (int, float, bool, str,
    None, list[...], Literal[...] and unions of them; others are not checked), one line each: for
    `check`, before a stage fails on them (the annotations are read from the source, as above)."""
    a = _init_args(name)
    if a is None:
        return []
    hints = {x.arg: x.annotation for x in a.args[3:] + a.kwonlyargs if x.annotation is not None}
    return [f"{key}: {value!r} is not {ast.unparse(hints[key])}" for key, value in args.items()
            if key in hints and _fits(value, hints[key]) is False]


def _fits(value, node: ast.expr) -> bool | None:
    """Whether `value` fits the annotation `node`; None where this cannot tell (another type)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        sides = (_fits(value, node.left), _fits(value, node.right))
        return True if True in sides else (None if None in sides else False)
    if isinstance(node, ast.Constant) and node.value is None:
        return value is None
    if isinstance(node, ast.Name):
        kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
        if node.id not in kinds:
            return None
        return isinstance(value, kinds[node.id]) and (node.id == "bool" or not isinstance(value, bool))
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        if node.value.id == "Literal":
            options = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return any(isinstance(o, ast.Constant) and o.value == value and type(o.value) is type(value)
                       for o in options)
        if node.value.id == "list":
            if not isinstance(value, list):
                return False
            each = [_fits(v, node.slice) for v in value]
            return False if False in each else (None if None in each else True)
    return None


def load(name: str):
    """The generator class registered as `name` (imports its family, then its module)."""
    module, cls = target(name).split(":")
    return getattr(importlib.import_module(module), cls)
