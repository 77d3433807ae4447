"""A pipeline's registered names (input processors, generators, model classes), checked before any
process starts: a typo is a config error naming the file, stage and field, not a stage crash later."""

from __future__ import annotations

from omni_server.config.schema import PipelineConfig
from omni_server.stage import generators, model_classes, processors

# Name lookups only: a generator's module (model code) is imported by its stage, not by `serve`.
_LOOKUPS = (("input_processor", processors.get), ("generator", generators.target), ("model_class", model_classes.get))


def problems(cfg: PipelineConfig, source: str) -> list[str]:
    out = []
    for stage in cfg.stages:
        for field, lookup in _LOOKUPS:
            name = getattr(stage, field, None)
            if not name:
                continue
            try:
                lookup(name)
            except KeyError as e:
                out.append(f"{source}: stage {stage.id} ({stage.name}): {field}: {e.args[0]}")
            except ModuleNotFoundError:
                family = name.split(".", 1)[0]
                out.append(f"{source}: stage {stage.id} ({stage.name}): {field}: unknown {field.replace('_', ' ')} "
                           f"{name!r} (no model family {family!r})")
        if stage.generator and stage.generator_args and not any(stage.generator in p for p in out):
            takes = generators.arguments(stage.generator)
            unknown = sorted(set(stage.generator_args) - takes[0]) if takes and not takes[1] else []
            if unknown:
                out.append(f"{source}: stage {stage.id} ({stage.name}): generator_args: {', '.join(map(repr, unknown))} "
                           f"not taken by generator {stage.generator!r} (it takes: {', '.join(sorted(takes[0]))})")
            for problem in generators.argument_problems(stage.generator, stage.generator_args):
                out.append(f"{source}: stage {stage.id} ({stage.name}): generator_args.{problem}")
    return out
