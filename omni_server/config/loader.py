"""Read a pipeline YAML into a validated `PipelineConfig`, with errors a person can act on.

Every problem is reported on its own line, naming the file, the stage and the field::

    configs/x.yaml: stage 1 (talker): engine_args: Input should be a valid dictionary (got 'oops')
    configs/x.yaml: stages[2].kind: Input should be 'ar' or 'generation' (got 'gen')
    configs/x.yaml: server.port: Input should be less than or equal to 65535 (got 70000)
    configs/x.yaml: stages: stage 1 (talker): input 3 must be an earlier stage (...)

Command-line overrides (`--stage-arg STAGE.KEY=VALUE`) are applied to the raw YAML before
validation, so a bad override is reported like a bad line in the file.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .schema import PipelineConfig, SamplingDefaults, StageConfig

__all__ = [
    "ConfigError",
    "StageOverride",
    "load_config",
    "load_config_text",
    "parse_override",
    "apply_overrides",
]

# Stage fields an override may set directly; any other KEY goes into `engine_args`.
# `id` and `name` identify the stage and cannot be overridden.
_STAGE_FIELDS = frozenset(StageConfig.model_fields) - {"id", "name"}
# Stage fields whose override VALUE is taken verbatim (a model path like `123` stays a string).
_STR_FIELDS = frozenset({"model", "tokenizer", "devices", "address", "input_processor"})
# Stage fields that are local paths or hub ids.
_PATH_FIELDS = ("model", "tokenizer")
# A local directory given as a stage's model / tokenizer holds at least one of these.
_CHECKPOINT_FILES = {"model": ("config.json", "params.json"),
                     "tokenizer": ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")}


class ConfigError(ValueError):
    """An unusable config; `str()` lists every problem, one per line."""

    def __init__(self, problems: Sequence[str] | str):
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = list(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)


# --------------------------------------------------------------------------- YAML


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error instead of last-one-wins."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    # The mapping's own keys only: one it also merges in (`<<: *anchor`) overrides the merged
    # value, as YAML's merge key defines.
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            dup = key in seen
        except TypeError:  # unhashable key; construct_mapping reports it below
            continue
        if dup:
            first = seen[key].start_mark
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first given on line {first.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node
    loader.flatten_mapping(node)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, name: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(p for p in (e.context, e.problem) if p) or str(e)
        raise ConfigError(f"{name}: {where}invalid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: invalid YAML: {e}") from None
    if data is None:
        raise ConfigError(f"{name}: the file is empty; expected a mapping with `model` and `stages`")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{name}: the top level must be a mapping with `model` and `stages`, got {_type_name(data)}"
        )
    _env_as_written(yaml.compose(text, Loader=_UniqueKeyLoader), data)  # noqa: S506
    return data


def _env_as_written(root: yaml.Node, data: dict[str, Any]) -> None:
    """Stages' `env` values as the file spells them: environment values are text, and YAML would
    read `1.10` as 1.1, `010` as 8, `0x1F` as 31 and `yes` as true."""
    stages = _child(root, "stages")
    if not isinstance(stages, yaml.SequenceNode) or not isinstance(data.get("stages"), list):
        return
    for node, stage in zip(stages.value, data["stages"]):
        _scalars_as_written(_child(node, "env"), stage.get("env") if isinstance(stage, dict) else None)


def _scalars_as_written(node: yaml.Node | None, values: Any) -> None:
    """A mapping's numbers and booleans as their YAML node spells them."""
    if not isinstance(node, yaml.MappingNode) or not isinstance(values, dict):
        return
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        written = values.get(key)
        if isinstance(value_node, yaml.ScalarNode) and isinstance(written, (bool, int, float)):
            values[key] = value_node.value


def _child(node: yaml.Node | None, key: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
                return value_node
    return None


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an int"}.get(
        type(v), f"a {type(v).__name__}"
    )


# --------------------------------------------------------------------------- overrides


class StageOverride(BaseModel):
    """One parsed `STAGE.KEY=VALUE`: `path` is where VALUE goes inside the stage's mapping."""

    text: str
    stage: str
    path: tuple[str, ...]
    value: Any
    # KEY named no stage field: an engine_args key, or a generator_args one on a generation stage.
    implicit: bool = False


def parse_override(text: str) -> StageOverride:
    """Parse `STAGE.KEY=VALUE` (see `apply_overrides`); raise ConfigError if malformed."""
    bad = f"override {text!r}: "
    lhs, eq, raw = text.partition("=")
    stage, dot, key = lhs.strip().partition(".")
    if not eq or not dot or not stage or not key:
        raise ConfigError(bad + "expected STAGE.KEY=VALUE, e.g. 1.max_num_seqs=8 or thinker.devices=0")
    parts = tuple(p.strip() for p in key.split("."))
    if any(not p for p in parts):
        raise ConfigError(bad + f"empty component in key {key!r}")
    head = parts[0]
    if head in ("id", "name"):
        raise ConfigError(bad + f"the stage's `{head}` cannot be overridden")
    implicit = head not in _STAGE_FIELDS
    if not implicit:
        path = parts
    else:  # engine_args key; dotted keys set nested engine args (e.g. compilation_config.level)
        path = ("engine_args", *parts)
    raw = raw.strip()
    # (A flow list, e.g. devices=[0,1] or one address per replica, is YAML as in the file.)
    # (An env value too: environment values are text, `env.VER=1.10` is "1.10", not 1.1.)
    as_text = len(path) == 1 and head in _STR_FIELDS or len(path) == 2 and head == "env"
    if as_text and raw not in ("", "null", "~") and not raw.startswith("["):
        value: Any = raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" else raw
    else:
        try:
            value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw else None  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(bad + f"VALUE is not a valid YAML value: {problem}") from None
        if path == ("env",):  # (a whole mapping, e.g. env={VER: 1.10}: its values as written too)
            _scalars_as_written(yaml.compose(raw, Loader=_UniqueKeyLoader), value)  # noqa: S506
    return StageOverride(text=text, stage=stage.strip(), path=path, value=value, implicit=implicit)


def _stage_desc(raw: Any) -> str:
    if not isinstance(raw, dict):
        return "?"
    return f"{raw.get('id', '?')} ({raw.get('name', '?')})"


def _find_stage(stages: list[Any], ref: str) -> dict | None:
    """The raw stage whose id (if `ref` is a number) or else name is `ref`."""
    dicts = [s for s in stages if isinstance(s, dict)]
    if ref.isdigit():
        for s in dicts:
            sid = s.get("id")
            if isinstance(sid, int) and not isinstance(sid, bool) and sid == int(ref):
                return s
    for s in dicts:
        if s.get("name") == ref:
            return s
    return None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str], name: str = "<string>") -> list[str]:
    """Apply `STAGE.KEY=VALUE` overrides to raw config `data` in place; return the problems.

    STAGE is a stage id or name (a number matches an id first). KEY is a StageConfig field
    (anything but `id`/`name`: e.g. devices, model, tokenizer, address, output, inputs) or a
    dotted path into one (`default_sampling.max_tokens`, `env.FOO`); any other KEY is an
    `engine_args` key (`max_num_seqs`, or dotted `compilation_config.level` for a nested one), on a
    generation stage a `generator_args` one (`chunk_frames`).
    VALUE is a YAML scalar or flow value: `8` -> 8, `true` -> True, `0.5` -> 0.5,
    `[1,2]` -> [1, 2], `null` -> None; for model/tokenizer/devices/address/input_processor it is
    taken as a string.
    """
    problems: list[str] = []
    # (YAML anchors and aliases load as one shared object: an override on one stage's `engine_args`
    # would change every stage that aliases it. Each stage gets its own copy first.)
    if overrides and isinstance(data.get("stages"), list):
        data["stages"] = [copy.deepcopy(stage) for stage in data["stages"]]  # (one copy each: unshared)
    stages = data.get("stages")
    for text in overrides:
        try:
            ov = parse_override(text)
        except ConfigError as e:
            problems.extend(f"{name}: {p}" for p in e.problems)
            continue
        if not isinstance(stages, list):
            problems.append(f"{name}: override {text!r}: the config has no list of `stages` to apply it to")
            continue
        stage = _find_stage(stages, ov.stage)
        if stage is None:
            known = ", ".join(_stage_desc(s) for s in stages) or "none"
            problems.append(f"{name}: override {text!r}: no stage with id or name {ov.stage!r} (stages: {known})")
            continue
        path = ov.path
        if ov.implicit and stage.get("kind") == "generation":  # (its arguments are the generator's)
            path = ("generator_args", *path[1:])
        node: Any = stage
        for i, part in enumerate(path[:-1]):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                where = ".".join(path[: i + 1])
                problems.append(f"{name}: override {text!r}: `{where}` is {_type_name(node)}, not a mapping")
                break
        else:
            node[path[-1]] = ov.value
    return problems


# --------------------------------------------------------------------------- validation errors


def _stage_label(stages: Any, index: int) -> tuple[str, bool]:
    """('stage 1 (talker)', True) when the raw stage's id/name can be read, else ('stages[2]', False)."""
    raw = stages[index] if isinstance(stages, list) and 0 <= index < len(stages) else None
    sid = raw.get("id") if isinstance(raw, dict) else None
    sname = raw.get("name") if isinstance(raw, dict) else None
    has_id = isinstance(sid, int) and not isinstance(sid, bool)
    has_name = isinstance(sname, str) and bool(sname)
    if has_id:
        return (f"stage {sid} ({sname})" if has_name else f"stage {sid}"), True
    if has_name:
        return f"stages[{index}] ({sname})", True
    return f"stages[{index}]", False


def _dotted(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _short(v: Any, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _known_fields(loc: Sequence[str | int]) -> list[str]:
    """Field names allowed at the mapping that holds `loc[-1]` (for 'did you mean')."""
    model: type[BaseModel] = PipelineConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        nxt = None
        for cand in (ann, *getattr(ann, "__args__", ())):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                nxt = cand
        if nxt is None:
            return []
        model = nxt
    return list(model.model_fields)


def _message(err: dict[str, Any]) -> str:
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    kind = err["type"]
    loc = err["loc"]
    if kind == "extra_forbidden" and loc and isinstance(loc[-1], str):
        close = difflib.get_close_matches(loc[-1], _known_fields(loc), n=1, cutoff=0.6)
        if close:
            msg += f" (did you mean `{close[0]}`?)"
    elif kind not in ("missing", "value_error", "assertion_error") and "input" in err:
        v = err["input"]
        if v is None or isinstance(v, (str, int, float, bool)):
            msg += f" (got {_short(v)})"
        elif isinstance(v, (list, dict)) and "should be a valid" in msg:
            msg += f" (got {_type_name(v)})"
    return msg


# A union member's tag pydantic puts in an error's location (`address.str`, `cuda_mps.literal['auto']`):
# not a key the user wrote.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


def _merged(errors: list[dict[str, Any]]) -> list[tuple[tuple, str]]:
    """(location, message) per place in the config: a value no member of a union took gets one line
    (`Input should be a valid string or a valid list (got 5)`), not one per member."""
    groups: dict[tuple, list[str]] = {}
    for err in errors:
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p)))
        groups.setdefault(loc, []).append(_message(err))
    out = []
    for loc, msgs in groups.items():
        if len(msgs) > 1:
            got = re.search(r" \(got [^()]*\)$", msgs[0])
            tail = got.group(0) if got and all(m.endswith(got.group(0)) for m in msgs) else ""
            parts = [m[: len(m) - len(tail)].split(", ")[0] for m in msgs]  # (not each member's why)
            if all(m.startswith("Input should be ") for m in parts):
                parts = [parts[0]] + [m[len("Input should be "):] for m in parts[1:]]
                msgs = [" or ".join(parts) + tail]
            else:
                msgs = ["; ".join(parts) + tail]
        out.append((loc, msgs[0]))
    return out


def _format_errors(exc: ValidationError, data: dict[str, Any], name: str) -> list[str]:
    stages = data.get("stages")
    lines: list[str] = []
    for loc, msg in _merged(exc.errors(include_url=False)):
        if not loc:
            # PipelineConfig's model_validator: the stage graph.
            lines.append(f"{name}: stages: {msg}")
        elif loc[0] == "stages" and len(loc) >= 2 and isinstance(loc[1], int):
            label, readable = _stage_label(stages, loc[1])
            rest = _dotted(loc[2:])
            if not rest:
                lines.append(f"{name}: {label}: {msg}")
            elif readable:
                lines.append(f"{name}: {label}: {rest}: {msg}")
            else:
                sep = "" if rest.startswith("[") else "."
                lines.append(f"{name}: {label}{sep}{rest}: {msg}")
        else:
            lines.append(f"{name}: {_dotted(loc)}: {msg}")
    return lines


# --------------------------------------------------------------------------- paths


def _resolve_path(value: str | None, base_dir: Path | None) -> str | None:
    """A relative `value` that exists under base_dir (then the cwd) becomes that absolute path;
    anything else (a hub id like `Qwen/Qwen2.5-Omni-7B`, a path that does not exist) is kept."""
    if not value:
        return value
    p = Path(os.path.expanduser(value))
    if p.is_absolute():
        return str(p) if value.startswith("~") else value
    for root in (base_dir, Path.cwd()):
        if root is None:
            continue
        cand = root / p
        if cand.exists():
            return str(cand.resolve())
    return value


def missing_paths(cfg: PipelineConfig, name: str, stage_id: int | None = None) -> list[str]:
    """Stages' model / tokenizer values that are local paths (absolute, `~`, `./`, `../`, or more
    than one `/`: a hub id is `org/name`) and do not exist; checked by `serve` and `check` before
    any stage starts (the hub client would otherwise take them for a malformed repo id, deep in a
    traceback). Not at load: a config may name paths of another machine (a container's /model).
    Also the api's own files: server.chat_template, the CURVE key, a runtime_dir its sockets fit in.
    `stage_id`: that stage's paths only (a stage process started alone, e.g. in its own container)."""
    out = []
    for stage in cfg.stages if stage_id is None else [cfg.stage(stage_id)]:
        for field in _PATH_FIELDS:
            value = getattr(stage, field)
            if value and Path(os.path.expanduser(value)).is_dir():
                # (an empty or wrong directory, e.g. one docker made for a missing mount, failed
                # each stage deep in transformers instead)
                wanted = _CHECKPOINT_FILES[field]
                if not any((Path(os.path.expanduser(value)) / f).exists() for f in wanted):
                    out.append(f"{name}: stage {stage.id} ({stage.name}): {field}: {value} holds no "
                               f"{' / '.join(wanted)}: not a {'checkpoint' if field == 'model' else 'tokenizer'} directory")
                continue
            if not value or Path(os.path.expanduser(value)).exists():
                continue
            if value.startswith(("/", "~", "./", "../")) or value.count("/") > 1:
                hint = " (`make tiny` builds the test models)" if "var/models" in value else ""
                out.append(f"{name}: stage {stage.id} ({stage.name}): {field}: no such directory: {value}{hint}")
    if stage_id is not None:
        return out
    template = cfg.server.chat_template
    if template and not Path(os.path.expanduser(template)).is_file():
        out.append(f"{name}: server: chat_template: no such file: {template}")
    elif template:  # (one that does not compile failed every chat with a 500 while /health said ok)
        why = _template_problem(Path(os.path.expanduser(template)))
        if why:
            out.append(f"{name}: server: chat_template: {template}: {why}")
    keys = cfg.server.curve_keys_dir
    if keys and not (Path(os.path.expanduser(keys)) / "omni.key_secret").is_file():
        out.append(f"{name}: server: curve_keys_dir: no omni.key_secret in {keys} (`omni-server keys {keys}` "
                   "makes one)")
    if cfg.runtime_dir:  # (ZMQ refuses an ipc path past its limit: the longest socket's here)
        import zmq

        longest = Path(cfg.runtime_dir) / f"stage{len(cfg.stages) - 1}.{max(s.replicas for s in cfg.stages)}.in"
        if len(str(longest)) > zmq.IPC_PATH_MAX_LEN:
            out.append(f"{name}: runtime_dir: {cfg.runtime_dir} is too long for its sockets' paths "
                       f"({len(str(longest))} characters, at most {zmq.IPC_PATH_MAX_LEN})")
        if stage_id is None:  # (serve's directory: wire/transport.py make_runtime_dir refuses the same)
            why = _runtime_dir_problem(Path(cfg.runtime_dir))
            if why:
                out.append(f"{name}: runtime_dir: {cfg.runtime_dir} {why}")
    return out


def _template_problem(path: Path) -> str | None:
    """Why the chat template in `path` cannot render (None: it compiles), as transformers compiles it."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(path.read_text())
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except jinja2.TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    return None


def _runtime_dir_problem(path: Path) -> str | None:
    """Why `serve` could not use `path` as its socket directory (None: it could)."""
    if path.exists():
        from omni_server.wire.transport import not_private

        return "is not a directory" if not path.is_dir() else not_private(path)
    parent = next(p for p in path.parents if p.exists())  # (serve makes the missing ones)
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created: {parent} is not writable"


def engine_arg_problems(cfg: PipelineConfig, name: str, stage_id: int | None = None) -> list[str]:
    """AR stages' engine_args keys that vLLM's EngineArgs does not take (a typo, a CLI spelling with
    dashes), with the closest names, and values that do not fit; for `check` (imports vLLM: seconds),
    and for a stage process its own (`stage_id`) before its engine is built."""
    import dataclasses
    import difflib

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    out = []
    for stage in cfg.stages if stage_id is None else [cfg.stage(stage_id)]:
        if stage.kind != "ar":
            continue
        for key, value in stage.engine_args.items():
            where = f"{name}: stage {stage.id} ({stage.name}): engine_args"
            if key not in known:
                close = difflib.get_close_matches(key.replace("-", "_"), sorted(known), n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                if key in SamplingDefaults.model_fields:  # (a request's sampling, not the engine's)
                    hint = f" (a sampling default: {stage.name}.default_sampling.{key})"
                out.append(f"{where}: vLLM takes no {key!r}{hint}")
            elif (why := _engine_arg_type_error(key, value)) is not None:
                out.append(f"{where}.{key}: {why}")
        if stage.model_class:  # (a stage's model class: its family is imported, as the stage will)
            from omni_server.stage import model_classes

            try:
                mc = model_classes.get(stage.model_class)
            except KeyError:  # (named where the stage's classes are checked)
                continue
            why = model_classes.quantization_problem(mc, stage.engine_args)
            if why is not None:
                out.append(f"{name}: stage {stage.id} ({stage.name}) (model_class {stage.model_class}): {why}")
    return out


def _engine_arg_type_error(key: str, value: Any) -> str | None:
    """Why `value` does not fit EngineArgs' annotation of `key` (None: it fits, or the annotation
    cannot be read). EngineArgs takes values as they are: `max_num_seqs: abc` failed deep in the
    engine's start with a TypeError that named no field."""
    adapter = _engine_arg_adapters().get(key)
    if adapter is None:
        return None
    import pydantic

    try:
        fitted = adapter.validate_python(value)
    except pydantic.ValidationError as e:
        return f"{value!r}: {e.errors()[0]['msg']}"
    except Exception:  # noqa: BLE001 (a validator of vLLM's own that raises otherwise: the engine says)
        return None
    if isinstance(value, str) and not isinstance(fitted, str):  # ("5", "yes": taken as they are, not converted)
        return f"{value!r} is a string; write it as {type(fitted).__name__} ({fitted!r})"
    if key in _COUNTS and isinstance(value, int) and value < 1 and value != _COUNTS[key]:
        return f"{value} must be at least 1" + (f" (or {_COUNTS[key]})" if _COUNTS[key] is not None else "")
    if key == "gpu_memory_utilization" and isinstance(value, (int, float)) and not 0 < value <= 1:
        return f"{value} must be above 0 and at most 1 (a fraction of the GPU's memory)"
    return None


# Counts and sizes EngineArgs takes as they are (`max_model_len: -5` failed deep in the engine's
# start), with the one value below 1 each means something: max_model_len -1 fits it to the memory.
_COUNTS: dict[str, int | None] = {"max_model_len": -1, "max_num_seqs": None, "max_num_batched_tokens": None,
                                  "tensor_parallel_size": None, "pipeline_parallel_size": None,
                                  "data_parallel_size": None, "kv_cache_memory_bytes": None}


@functools.cache
def _engine_arg_adapters() -> dict[str, Any]:
    """pydantic validators of EngineArgs' annotated field types, those that can be read."""
    import dataclasses

    import pydantic
    from vllm.engine import arg_utils

    out = {}
    for f in dataclasses.fields(arg_utils.EngineArgs):
        try:
            out[f.name] = pydantic.TypeAdapter(eval(f.type, vars(arg_utils)) if isinstance(f.type, str) else f.type)
        except Exception:  # noqa: BLE001 (an annotation naming what the module does not import)
            continue
    return out


# --------------------------------------------------------------------------- entry points


def load_config_text(
    text: str,
    name: str = "<string>",
    overrides: Sequence[str] = (),
    base_dir: str | os.PathLike[str] | None = None,
) -> PipelineConfig:
    """Parse and validate config YAML `text`; `name` labels errors; relative model/tokenizer
    paths resolve against `base_dir` (if given), then the current directory."""
    data = _parse_yaml(text, name)
    problems = apply_overrides(data, overrides, name)
    server = data.get("server") if isinstance(data, dict) else None
    if isinstance(server, dict) and isinstance(server.get("media_url_ca_file"), str):
        # (read while validating: relative to the config file first, as every other path in it)
        server["media_url_ca_file"] = _resolve_path(server["media_url_ca_file"],
                                                    Path(base_dir) if base_dir is not None else None)
    cfg: PipelineConfig | None = None
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        problems.extend(_format_errors(e, data, name))
    if problems:
        raise ConfigError(problems)
    assert cfg is not None
    base = Path(base_dir) if base_dir is not None else None
    for stage in cfg.stages:
        for field in _PATH_FIELDS:
            setattr(stage, field, _resolve_path(getattr(stage, field), base))
    cfg.server.curve_keys_dir = _resolve_path(cfg.server.curve_keys_dir, base)
    cfg.server.chat_template = _resolve_path(cfg.server.chat_template, base)
    if cfg.runtime_dir:  # (made by serve if missing: the config's directory, whatever the cwd of
        # serve and of external stages reading the same file)
        rd = Path(os.path.expanduser(cfg.runtime_dir))
        cfg.runtime_dir = str(rd if rd.is_absolute() or base is None else base / rd)
    return cfg


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> PipelineConfig:
    """Read the pipeline YAML at `path`, apply `--stage-arg` overrides, validate, and resolve
    relative model/tokenizer paths against the file's directory (then the cwd).

    Raises ConfigError (a ValueError) listing every problem found."""
    name = os.fspath(path)
    p = Path(name)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{name}: is a directory, not a config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{name}: cannot read config file: {e.strerror or e}") from None
    return load_config_text(text, name=name, overrides=overrides, base_dir=p.resolve().parent)
