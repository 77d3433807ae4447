"""Config loader: error messages for broken YAML, overrides, path resolution (no engines)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omni_server.config import (
    ConfigError,
    PipelineConfig,
    load_config,
    load_config_text,
    parse_override,
)
from tests.conftest import MODELS, REPO

VALID = """\
model: qwen-omni
stages:
  - id: 0
    name: thinker
    model: Qwen/Qwen2.5-Omni-7B
    engine_args:
      max_num_seqs: 4
      gpu_memory_utilization: 0.8
    devices: "0"
    output: text
    default_sampling:
      max_tokens: 64
      temperature: 0.7
  - id: 1
    name: talker
    model: Qwen/Qwen2.5-Omni-7B
    inputs: [0]
    input_processor: thinker2talker
    output: tokens
server:
  port: 8123
"""

STAGE0 = "  - {id: 0, name: thinker, model: m, output: text}\n"

# (case id, YAML document, expected line after "configs/x.yaml: ")
BROKEN = [
    (
        "missing-model",
        "stages:\n" + STAGE0,
        "model: Field required",
    ),
    (
        "empty-model",
        "model: ''\nstages:\n" + STAGE0,
        "model: String should have at least 1 character (got '')",
    ),
    (
        "missing-stages",
        "model: m\n",
        "stages: Field required",
    ),
    (
        "empty-stages",
        "model: m\nstages: []\n",
        "stages: List should have at least 1 item after validation, not 0",
    ),
    (
        "stages-not-a-list",
        "model: m\nstages: {id: 0}\n",
        "stages: Input should be a valid list (got a mapping)",
    ),
    (
        "stage-not-a-mapping",
        "model: m\nstages:\n" + STAGE0 + "  - just a string\n",
        "stages[1]: Input should be a valid dictionary or instance of StageConfig (got 'just a string')",
    ),
    (
        "stage-missing-model",
        "model: m\nstages:\n  - {id: 0, name: thinker, output: text}\n",
        "stage 0 (thinker): model: Field required",
    ),
    (
        "stage-missing-name-uses-id",
        "model: m\nstages:\n  - {id: 0, model: m, output: text}\n",
        "stage 0: name: Field required",
    ),
    (
        "bad-stage-name",
        "model: m\nstages:\n  - {id: 0, name: 'my stage', model: m, output: text}\n",
        "stage 0 (my stage): name: String should match pattern '^[A-Za-z0-9_\\-]+$' (got 'my stage')",
    ),
    (
        "negative-stage-id",
        "model: m\nstages:\n  - {id: -1, name: thinker, model: m, output: text}\n",
        "stage -1 (thinker): id: Input should be greater than or equal to 0 (got -1)",
    ),
    (
        "stage-ids-out-of-order",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 2, name: talker, model: m}\n",
        "stages: stage ids must be 0..1 in order, got [0, 2]",
    ),
    (
        "duplicate-stage-names",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 1, name: thinker, model: m}\n",
        "stages: duplicate stage names: ['thinker']",
    ),
    (
        "bad-kind",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 1, name: talker, kind: gen, model: m}\n",
        "stage 1 (talker): kind: Input should be 'ar' or 'generation' (got 'gen')",
    ),
    (
        "bad-kind-unnamed-stage-uses-index",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 1, name: a, model: m}\n  - {kind: gen, model: m}\n",
        "stages[2].kind: Input should be 'ar' or 'generation' (got 'gen')",
    ),
    (
        "engine-args-not-a-mapping",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 1, name: talker, model: m, engine_args: [max_num_seqs]}\n",
        "stage 1 (talker): engine_args: Input should be a valid dictionary (got a list)",
    ),
    (
        "union-field-one-line-not-one-per-member",
        "model: m\nstages:\n  - {id: 0, name: thinker, model: m, output: text, address: 5}\n",
        "stage 0 (thinker): address: Input should be a valid string or a valid list (got 5)",
    ),
    (
        "union-field-literal-member",
        "model: m\ncuda_mps: maybe\nstages:\n" + STAGE0,
        "cuda_mps: Input should be a valid boolean or 'auto' (got 'maybe')",
    ),
    (
        "unknown-top-level-field",
        "model: m\nmodle: x\nstages:\n" + STAGE0,
        "modle: Extra inputs are not permitted (did you mean `model`?)",
    ),
    (
        "unknown-stage-field-typo",
        "model: m\nstages:\n  - {id: 0, name: thinker, model: m, output: text, engin_args: {}}\n",
        "stage 0 (thinker): engin_args: Extra inputs are not permitted (did you mean `engine_args`?)",
    ),
    (
        "unknown-sampling-field",
        "model: m\nstages:\n  - {id: 0, name: thinker, model: m, output: text, default_sampling: {max_token: 5}}\n",
        "stage 0 (thinker): default_sampling.max_token: Extra inputs are not permitted (did you mean `max_tokens`?)",
    ),
    (
        "input-from-later-stage",
        "model: m\nstages:\n"
        + STAGE0
        + "  - {id: 1, name: talker, model: m, inputs: [2], input_processor: p}\n"
        + "  - {id: 2, name: code2wav, model: m, inputs: [0], input_processor: p}\n",
        "stages: stage 1 (talker): input 2 must be an earlier stage (the pipeline is a DAG in id order)",
    ),
    (
        "input-from-itself",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 1, name: talker, model: m, inputs: [1], input_processor: p}\n",
        "stages: stage 1 (talker): a stage cannot take its own output as input",
    ),
    (
        "duplicate-id-feeding-itself",  # (the ids are the mistake, not the input: checked first)
        "model: m\nstages:\n" + STAGE0 + "  - {id: 0, name: talker, model: m, inputs: [0], input_processor: p}\n",
        "stages: stage ids must be 0..1 in order, got [0, 0]",
    ),
    (
        "negative-input",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 1, name: talker, model: m, inputs: [-1], input_processor: p}\n",
        "stage 1 (talker): inputs[0]: Input should be greater than or equal to 0 (got -1)",
    ),
    (
        "duplicate-input",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 1, name: talker, model: m, inputs: [0, 0], input_processor: p}\n",
        "stage 1 (talker): `inputs` lists a stage more than once: [0, 0]",
    ),
    (
        "inputs-without-input-processor",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 1, name: talker, model: m, inputs: [0]}\n",
        "stage 1 (talker): a stage with `inputs` needs an `input_processor`",
    ),
    (
        "input-processor-without-inputs",
        "model: m\nstages:\n" + STAGE0 + "  - {id: 1, name: talker, model: m, input_processor: p}\n",
        "stage 1 (talker): `input_processor` is set but the stage has no `inputs`",
    ),
    (
        "two-text-outputs",
        "model: m\nstages:\n"
        + STAGE0
        + "  - {id: 1, name: talker, model: m, inputs: [0], input_processor: p, output: text}\n",
        "stages: at most one stage can have `output: text`, got stages [0, 1]",
    ),
    (
        "bad-output",
        "model: m\nstages:\n  - {id: 0, name: thinker, model: m, output: speech}\n",
        "stage 0 (thinker): output: Input should be 'text', 'tokens' or 'audio' (got 'speech')",
    ),
    (
        "audio-from-ar",
        "model: m\nstages:\n  - {id: 0, name: thinker, model: m, output: audio}\n",
        "stage 0 (thinker): `output: audio` needs a `generation` stage",
    ),
    (
        "generation-without-generator",
        "model: m\nstages:\n  - {id: 0, name: a, model: m, output: text}\n"
        "  - {id: 1, name: b, kind: generation, model: m, inputs: [0], input_processor: p, output: audio}\n",
        "stage 1 (b): a `generation` stage needs a `generator`",
    ),
    (
        "omni-sampler-on-generation",
        "model: m\nstages:\n  - {id: 0, name: a, model: m, output: text}\n"
        "  - {id: 1, name: b, kind: generation, model: m, generator: g, inputs: [0], input_processor: p,"
        " output: audio, sampler: omni}\n",
        "stage 1 (b): `sampler` is for `ar` stages",
    ),
    (
        "generator-on-ar",
        "model: m\nstages:\n  - {id: 0, name: a, model: m, output: text, generator: g}\n",
        "stage 0 (a): `generator` / `generator_args` are only for `kind: generation` stages",
    ),
    (
        "generator-args-on-ar",
        "model: m\nstages:\n  - {id: 0, name: a, model: m, output: text, generator_args: {chunk_frames: 72}}\n",
        "stage 0 (a): `generator` / `generator_args` are only for `kind: generation` stages",
    ),
    (
        "no-stage-with-output",
        "model: m\nstages:\n  - {id: 0, name: thinker, model: m}\n",
        "stages: no stage has an `output` for the client",
    ),
    (
        "port-too-big",
        "model: m\nserver: {port: 70000}\nstages:\n" + STAGE0,
        "server.port: Input should be less than or equal to 65535 (got 70000)",
    ),
    (
        "port-not-a-number",
        "model: m\nserver: {port: http}\nstages:\n" + STAGE0,
        "server.port: Input should be a valid integer, unable to parse string as an integer (got 'http')",
    ),
    (
        "unknown-server-field",
        "model: m\nserver: {prot: 80}\nstages:\n" + STAGE0,
        "server.prot: Extra inputs are not permitted (did you mean `port`?)",
    ),
    (
        "negative-max-tokens",
        "model: m\nstages:\n  - {id: 0, name: thinker, model: m, output: text, default_sampling: {max_tokens: -5}}\n",
        "stage 0 (thinker): default_sampling.max_tokens: Input should be greater than or equal to 1 (got -5)",
    ),
    (
        "top-p-out-of-range",
        "model: m\nstages:\n  - {id: 0, name: thinker, model: m, output: text, default_sampling: {top_p: 1.5}}\n",
        "stage 0 (thinker): default_sampling.top_p: Input should be less than or equal to 1 (got 1.5)",
    ),
    (
        "yaml-syntax-error",
        "model: m\nstages:\n  - id: 0\n    name: thinker\n   model: m\n",
        "line 5, column 4: invalid YAML:",
    ),
    (
        "yaml-unclosed-flow",
        "model: m\nstages: [\n",
        "line 3, column 1: invalid YAML:",
    ),
    (
        "yaml-duplicate-key",
        "model: m\nstages:\n  - id: 0\n    name: thinker\n    model: m\n    model: n\n",
        "line 6, column 5: invalid YAML: duplicate key 'model' (first given on line 5)",
    ),
    (
        "empty-file",
        "",
        "the file is empty; expected a mapping with `model` and `stages`",
    ),
    (
        "top-level-list",
        "- model: m\n",
        "the top level must be a mapping with `model` and `stages`, got a list",
    ),
]


def _write(tmp_path: Path, text: str, rel: str = "configs/x.yaml") -> Path:
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _problems(exc: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    lines = str(exc.value).splitlines()
    assert lines == exc.value.problems
    return lines


@pytest.mark.parametrize("text,expected", [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_broken_config_message(tmp_path, monkeypatch, text, expected):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_config("configs/x.yaml")
    assert isinstance(exc.value, ValueError)
    lines = _problems(exc)
    want = f"configs/x.yaml: {expected}"
    assert any(line == want or (want.endswith(":") and line.startswith(want)) for line in lines), "\n".join(lines)
    # Every line names the file.
    assert all(line.startswith("configs/x.yaml: ") for line in lines)


def test_every_problem_is_listed_one_per_line():
    text = textwrap.dedent(
        """\
        model: m
        colour: blue
        server: {port: -1}
        stages:
          - {id: 0, name: thinker, model: m, output: text, engine_args: 3}
          - {id: 1, name: talker, kind: gen, model: m, inputs: [0], input_processor: p}
        """
    )
    with pytest.raises(ConfigError) as exc:
        load_config_text(text, name="x.yaml")
    assert sorted(_problems(exc)) == sorted(
        [
            "x.yaml: colour: Extra inputs are not permitted",
            "x.yaml: server.port: Input should be greater than or equal to 0 (got -1)",
            "x.yaml: stage 0 (thinker): engine_args: Input should be a valid dictionary (got 3)",
            "x.yaml: stage 1 (talker): kind: Input should be 'ar' or 'generation' (got 'gen')",
        ]
    )


def test_yaml_syntax_error_has_no_traceback_chain():
    with pytest.raises(ConfigError) as exc:
        load_config_text("a: [1, 2\nb: 3\n", name="y.yaml")
    (line,) = _problems(exc)
    assert line.startswith("y.yaml: line ")
    assert exc.value.__suppress_context__


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as exc:
        load_config(missing)
    assert str(exc.value) == f"{missing}: no such config file"


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path)
    assert str(exc.value) == f"{tmp_path}: is a directory, not a config file"


# --------------------------------------------------------------------------- valid configs


def test_valid_two_stage_config(tmp_path):
    cfg = load_config(_write(tmp_path, VALID))
    assert isinstance(cfg, PipelineConfig)
    assert cfg.model == "qwen-omni"
    assert [(s.id, s.name, s.kind) for s in cfg.stages] == [(0, "thinker", "ar"), (1, "talker", "ar")]
    thinker, talker = cfg.stages
    assert thinker.engine_args == {"max_num_seqs": 4, "gpu_memory_utilization": 0.8}
    assert thinker.devices == "0"
    assert thinker.output == "text" and talker.output == "tokens"
    assert thinker.default_sampling.max_tokens == 64
    assert thinker.default_sampling.temperature == 0.7
    assert talker.inputs == [0] and talker.input_processor == "thinker2talker"
    assert cfg.consumers(0) == [1]
    assert cfg.server.port == 8123 and cfg.server.host == "127.0.0.1"
    # A hub id with no such local path is left alone.
    assert thinker.model == "Qwen/Qwen2.5-Omni-7B"
    assert thinker.tokenizer is None


def test_numeric_devices_and_env_from_yaml_become_strings():
    text = VALID.replace('devices: "0"', "devices: [0, 1]\n    env: {OMP_NUM_THREADS: 4, FOO: bar}")
    cfg = load_config_text(text)
    assert cfg.stages[0].devices == "0,1"
    assert cfg.stages[0].env == {"OMP_NUM_THREADS": "4", "FOO": "bar"}
    cfg = load_config_text(VALID.replace('devices: "0"', "devices: 1"))
    assert cfg.stages[0].devices == "1"


# --------------------------------------------------------------------------- overrides


def test_overrides_parse_values_by_id_and_name():
    cfg = load_config_text(
        VALID,
        overrides=[
            "1.max_num_seqs=8",
            "thinker.gpu_memory_utilization=0.5",
            "talker.enforce_eager=true",
            "1.cuda_graph_sizes=[1, 2]",
            "thinker.served_name='abc'",
            "talker.trust_remote_code=null",
        ],
    )
    thinker, talker = cfg.stages
    assert thinker.engine_args == {"max_num_seqs": 4, "gpu_memory_utilization": 0.5, "served_name": "abc"}
    assert talker.engine_args == {
        "max_num_seqs": 8,
        "enforce_eager": True,
        "cuda_graph_sizes": [1, 2],
        "trust_remote_code": None,
    }
    assert type(talker.engine_args["max_num_seqs"]) is int
    assert type(thinker.engine_args["gpu_memory_utilization"]) is float


def test_overrides_set_stage_fields():
    cfg = load_config_text(
        VALID,
        overrides=[
            "0.devices=1",
            "talker.devices=2,3",
            "thinker.model=/ckpt/thinker",
            "talker.tokenizer=123",
            "1.address=tcp://127.0.0.1:5555",
            "1.output=null",
            "0.startup_timeout_s=30",
            "1.env.FOO=bar",
            "talker.kind=generation",
            "talker.generator=fam.gen",
        ],
    )
    thinker, talker = cfg.stages
    assert thinker.devices == "1" and talker.devices == "2,3"
    assert thinker.model == "/ckpt/thinker"
    assert talker.tokenizer == "123"
    assert talker.address == "tcp://127.0.0.1:5555"
    assert talker.output is None
    assert thinker.startup_timeout_s == 30.0
    assert talker.env == {"FOO": "bar"}
    assert talker.kind == "generation" and talker.generator == "fam.gen"
    # None of these leaked into engine_args.
    assert "devices" not in thinker.engine_args and "model" not in thinker.engine_args
    assert talker.engine_args == {}


def test_override_nested_fields():
    cfg = load_config_text(
        VALID,
        overrides=[
            "thinker.default_sampling.max_tokens=5",
            "1.default_sampling.temperature=0",
            "1.default_sampling.stop_token_ids=[7, 8]",
            "0.compilation_config.level=3",
        ],
    )
    thinker, talker = cfg.stages
    assert thinker.default_sampling.max_tokens == 5
    assert thinker.default_sampling.temperature == 0.7  # untouched sibling
    assert talker.default_sampling.temperature == 0.0
    assert talker.default_sampling.stop_token_ids == [7, 8]
    assert thinker.engine_args["compilation_config"] == {"level": 3}


def test_override_value_is_validated_like_the_file():
    with pytest.raises(ConfigError) as exc:
        load_config_text(VALID, name="c.yaml", overrides=["thinker.default_sampling.max_tokens=-1"])
    assert _problems(exc) == [
        "c.yaml: stage 0 (thinker): default_sampling.max_tokens: Input should be greater than or equal to 1 (got -1)"
    ]


def test_a_sub_model_stage_takes_only_fp8_quantized_at_load():
    """vLLM 0.26 reads a quantization only with dict `hf_overrides`; a sub-model stage (the talker)
    gets `fp8` through its sub-config instead (tests/test_engine_args.py), and any other method or a
    `quantization_config` would die at engine start with an error naming neither: named by `check`
    and by the stage before its engine is built. A whole checkpoint's model class (the thinker's)
    takes any of vLLM's: its architecture goes in a dict `hf_overrides`."""
    from omni_server.config.loader import engine_arg_problems
    from omni_server.stage import model_classes

    path = REPO / "configs" / "qwen2_5_omni.yaml"
    assert engine_arg_problems(load_config(str(path), overrides=["talker.quantization=fp8"]), "c") == []
    for override, named in (("talker.quantization=awq", "`engine_args.quantization: awq`"),
                            ("talker.quantization_config={linear: fp8_per_tensor}",
                             "`engine_args.quantization_config`")):
        (line,) = engine_arg_problems(load_config(str(path), overrides=[override]), "c")
        assert line.startswith(f"c: stage 1 (talker) (model_class qwen2_5_omni.talker): {named}"), line
        assert "sub-model of the checkpoint" in line
    cfg = load_config(str(path), overrides=["thinker.quantization=awq"])
    assert cfg.stage(0).model_class and engine_arg_problems(cfg, "c") == []
    args = model_classes.engine_overrides(model_classes.get(cfg.stage(0).model_class), cfg.stage(0).engine_args)
    assert args["quantization"] == "awq" and args["hf_overrides"] == {"architectures": ["OmniServerQwen2_5OmniThinker"]}


def test_override_unknown_stage():
    with pytest.raises(ConfigError) as exc:
        load_config_text(VALID, name="c.yaml", overrides=["code2wav.max_num_seqs=8", "7.max_num_seqs=8"])
    assert _problems(exc) == [
        "c.yaml: override 'code2wav.max_num_seqs=8': no stage with id or name 'code2wav' (stages: 0 (thinker), 1 (talker))",
        "c.yaml: override '7.max_num_seqs=8': no stage with id or name '7' (stages: 0 (thinker), 1 (talker))",
    ]


@pytest.mark.parametrize(
    "override,reason",
    [
        ("max_num_seqs=8", "expected STAGE.KEY=VALUE"),
        ("1.max_num_seqs", "expected STAGE.KEY=VALUE"),
        ("1=8", "expected STAGE.KEY=VALUE"),
        (".max_num_seqs=8", "expected STAGE.KEY=VALUE"),
        ("1.=8", "expected STAGE.KEY=VALUE"),
        ("1.default_sampling..max_tokens=8", "empty component in key 'default_sampling..max_tokens'"),
        ("1.max_num_seqs=[1, 2", "VALUE is not a valid YAML value"),
        ("1.name=x", "the stage's `name` cannot be overridden"),
        ("0.id=3", "the stage's `id` cannot be overridden"),
    ],
)
def test_malformed_override(override, reason):
    with pytest.raises(ConfigError) as exc:
        load_config_text(VALID, name="c.yaml", overrides=[override])
    (line,) = _problems(exc)
    assert line.startswith(f"c.yaml: override {override!r}: {reason}"), line


def test_override_into_non_mapping_is_reported():
    text = VALID.replace("    output: tokens\n", "    output: tokens\n    default_sampling: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_config_text(text, name="c.yaml", overrides=["1.default_sampling.max_tokens=5"])
    assert _problems(exc)[0] == (
        "c.yaml: override '1.default_sampling.max_tokens=5': `default_sampling` is an int, not a mapping"
    )


def test_override_errors_and_file_errors_are_listed_together():
    text = VALID.replace("port: 8123", "port: 99999")
    with pytest.raises(ConfigError) as exc:
        load_config_text(text, name="c.yaml", overrides=["nope.x=1"])
    lines = _problems(exc)
    assert len(lines) == 2
    assert lines[0].startswith("c.yaml: override 'nope.x=1': no stage")
    assert lines[1] == "c.yaml: server.port: Input should be less than or equal to 65535 (got 99999)"


def test_parse_override_routes_keys():
    assert parse_override("1.max_num_seqs=8").path == ("engine_args", "max_num_seqs")
    assert parse_override("1.engine_args.max_num_seqs=8").path == ("engine_args", "max_num_seqs")
    assert parse_override("t.devices=0").path == ("devices",)
    assert parse_override("t.devices=0").value == "0"
    assert parse_override("t.default_sampling.seed=1").path == ("default_sampling", "seed")
    ov = parse_override(" thinker . gpu_memory_utilization = 0.5 ")
    assert (ov.stage, ov.path, ov.value) == ("thinker", ("engine_args", "gpu_memory_utilization"), 0.5)
    assert parse_override("1.x=a=b").value == "a=b"


def test_numeric_stage_ref_prefers_id_over_name():
    text = VALID.replace("name: talker", "name: '0'")
    cfg = load_config_text(text, overrides=["0.max_num_seqs=9"])
    assert cfg.stages[0].engine_args["max_num_seqs"] == 9
    assert "max_num_seqs" not in cfg.stages[1].engine_args


# --------------------------------------------------------------------------- paths


def _path_config(model: str, tokenizer: str | None = None) -> str:
    tok = f"\n    tokenizer: {tokenizer}" if tokenizer else ""
    return f"model: m\nstages:\n  - id: 0\n    name: thinker\n    model: {model}{tok}\n    output: text\n"


def test_model_path_relative_to_config_dir(tmp_path, monkeypatch):
    (tmp_path / "var/models/x").mkdir(parents=True)
    (tmp_path / "var/tok").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the cwd must not matter
    path = _write(tmp_path, _path_config("../var/models/x", "../var/tok"))
    cfg = load_config(path)
    assert cfg.stages[0].model == str((tmp_path / "var/models/x").resolve())
    assert cfg.stages[0].tokenizer == str((tmp_path / "var/tok").resolve())


def test_runtime_dir_relative_to_config_dir(tmp_path, monkeypatch):
    """serve and external stages may run from different directories: a relative runtime_dir (made
    by serve if missing) is the config file's, never the cwd's."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    config = "model: m\nruntime_dir: %s\nstages:\n  - {id: 0, name: a, model: x, output: text}\n"
    (tmp_path / "c.yaml").write_text(config % "run/sockets")
    assert load_config(tmp_path / "c.yaml").runtime_dir == str(tmp_path / "run/sockets")
    (tmp_path / "c.yaml").write_text(config % "~/sockets")
    assert load_config(tmp_path / "c.yaml").runtime_dir == os.path.expanduser("~/sockets")


def test_model_path_falls_back_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "var/models/x").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(_write(tmp_path, _path_config("var/models/x")))  # configs/var/models/x does not exist
    assert cfg.stages[0].model == str((tmp_path / "var/models/x").resolve())


def test_config_dir_wins_over_cwd(tmp_path, monkeypatch):
    (tmp_path / "configs/var/models/x").mkdir(parents=True)
    (tmp_path / "var/models/x").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(_write(tmp_path, _path_config("var/models/x")))
    assert cfg.stages[0].model == str((tmp_path / "configs/var/models/x").resolve())


def test_hub_ids_and_missing_paths_untouched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(_write(tmp_path, _path_config("Qwen/Qwen2.5-Omni-7B", "../var/not-there")))
    assert cfg.stages[0].model == "Qwen/Qwen2.5-Omni-7B"
    assert cfg.stages[0].tokenizer == "../var/not-there"


def test_absolute_model_path_kept(tmp_path):
    target = tmp_path / "abs-model"
    target.mkdir()
    cfg = load_config(_write(tmp_path, _path_config(str(target))))
    assert cfg.stages[0].model == str(target)


def test_overridden_model_path_is_resolved_too(tmp_path, monkeypatch):
    (tmp_path / "var/models/y").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "var")
    path = _write(tmp_path, _path_config("Qwen/Qwen2.5-Omni-7B"))
    cfg = load_config(path, overrides=["thinker.model=../var/models/y"])
    assert cfg.stages[0].model == str((tmp_path / "var/models/y").resolve())


def test_load_config_text_resolves_against_base_dir(tmp_path):
    (tmp_path / "models/z").mkdir(parents=True)
    cfg = load_config_text(_path_config("models/z"), base_dir=tmp_path)
    assert cfg.stages[0].model == str((tmp_path / "models/z").resolve())


def test_curve_keys_dir_resolves_against_the_config_file(tmp_path):
    (tmp_path / "configs" / "keys").mkdir(parents=True)
    cfg = load_config(_write(tmp_path, _path_config("m") + "server: {curve_keys_dir: keys}\n"))
    assert cfg.server.curve_keys_dir == str((tmp_path / "configs" / "keys").resolve())


def test_keys_command_refuses_to_overwrite(tmp_path):
    import subprocess
    import sys

    def keys():
        return subprocess.run([sys.executable, "-m", "omni_server.cli", "keys", str(tmp_path / "k")],
                              capture_output=True, text=True, timeout=60)

    first = keys()
    assert first.returncode == 0 and (tmp_path / "k" / "omni.key_secret").stat().st_mode & 0o777 == 0o600
    secret = (tmp_path / "k" / "omni.key_secret").read_bytes()
    second = keys()
    assert second.returncode == 1 and "exists" in second.stderr and "Traceback" not in second.stderr
    assert (tmp_path / "k" / "omni.key_secret").read_bytes() == secret


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    """What users start from loads: stages, registered processors / generators / model classes."""
    from omni_server.stage.names import problems

    cfg = load_config(str(path))
    assert cfg.stages and cfg.model and problems(cfg, path.name) == []


def test_check_names_unknown_processors_generators_and_families(tmp_path):
    path = tmp_path / "typos.yaml"
    path.write_text(textwrap.dedent("""\
        model: m
        stages:
          - {id: 0, name: a, model: x, model_class: qwen2_5_omni.talkr, output: text}
          - {id: 1, name: b, model: x, inputs: [0], input_processor: nofamily.proc}
          - {id: 2, name: c, kind: generation, model: x, generator: qwen2_5_omni.tokenwav, inputs: [1],
             input_processor: qwen2_5_omni.talker_to_token2wav, output: audio}
        """))
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "check", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()[1:]
    assert len(lines) == 3, proc.stderr
    assert lines[0].startswith(f"{path}: stage 0 (a): model_class: unknown model class 'qwen2_5_omni.talkr'")
    assert lines[1] == (f"{path}: stage 1 (b): input_processor: unknown input processor 'nofamily.proc' "
                        "(no model family 'nofamily')")
    assert lines[2].startswith(f"{path}: stage 2 (c): generator: unknown generator 'qwen2_5_omni.tokenwav'; known:")


def test_an_unknown_name_lists_every_familys_names():
    """A name without its family (`talker`): the error lists what every family registered, not only
    those imported so far (a fresh process: none)."""
    code = ("from omni_server.stage import generators, model_classes, processors\n"
            "for get, name in ((model_classes.get, 'talker'), (processors.get, 'thinker_to_talker'), "
            "(generators.target, 'token2wav')):\n"
            "    try:\n        get(name)\n    except KeyError as e:\n        print(e.args[0])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    model_class, processor, generator = proc.stdout.strip().splitlines()
    assert "'qwen2_5_omni.talker'" in model_class and "'qwen3_omni_moe.talker'" in model_class
    assert "'qwen2_5_omni.thinker_to_talker'" in processor and "'qwen3_omni_moe.thinker_to_talker'" in processor
    assert "'qwen2_5_omni.token2wav'" in generator and "'qwen3_omni_moe.code2wav'" in generator


def test_check_and_serve_name_a_local_model_path_that_does_not_exist(tmp_path):
    """A model path that is not there (absolute, relative, the tiny models before `make tiny`):
    `check` and `serve` say which stage and field before any stage starts (not the hub client's
    traceback about a malformed repo id). Hub ids (`org/name`) are left to the hub."""
    path = tmp_path / "missing.yaml"
    path.write_text(textwrap.dedent("""\
        model: m
        stages:
          - {id: 0, name: a, model: /nowhere/Qwen2.5-Omni-7B, output: text}
          - {id: 1, name: b, model: ../var/models/tiny-nothing, tokenizer: Qwen/Qwen2.5-Omni-7B, inputs: [0],
             input_processor: hidden_to_embeds, output: tokens}
        server: {chat_template: no-such-template.jinja, curve_keys_dir: /nowhere/keys}
        runtime_dir: /tmp/%s
        """ % ("r" * 100)))
    for cmd in ("check", "serve"):
        proc = subprocess.run([sys.executable, "-m", "omni_server.cli", cmd, str(path)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[1:] == [
            f"{path}: stage 0 (a): model: no such directory: /nowhere/Qwen2.5-Omni-7B",
            f"{path}: stage 1 (b): model: no such directory: ../var/models/tiny-nothing (`make tiny` builds the "
            "test models)", f"{path}: server: chat_template: no such file: no-such-template.jinja",
            f"{path}: server: curve_keys_dir: no omni.key_secret in /nowhere/keys (`omni-server keys /nowhere/keys` "
            "makes one)",
            f"{path}: runtime_dir: /tmp/{'r' * 100} is too long for its sockets' paths (117 characters, at most 107)"]


def test_check_and_serve_name_a_chat_template_that_does_not_compile(tmp_path):
    """A server.chat_template with a Jinja syntax error: named with its line by `check` and by `serve`
    before any stage starts (it served, /health 200, and failed every chat with a 500)."""
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% for x in %}broken\n")
    path = tmp_path / "pipeline.yaml"
    path.write_text((REPO / "configs" / "default.yaml").read_text().replace("../var/models", str(REPO / "var/models"))
                    + f"\nserver: {{chat_template: {template}}}\n")
    for cmd in ("check", "serve"):
        proc = subprocess.run([sys.executable, "-m", "omni_server.cli", cmd, str(path)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{path}: server: chat_template: {template}: line 2: " in proc.stderr, proc.stderr
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")  # (a good one: check passes)
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "check", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_local_directory_that_is_no_checkpoint_is_named_before_any_stage_starts(tmp_path):
    """An empty model directory (docker makes one for a bind mount whose source is missing) or one
    without tokenizer files: `check` / `serve` name it, instead of every stage failing deep in
    transformers."""
    from omni_server.config.loader import missing_paths

    empty, weights_only = tmp_path / "empty", tmp_path / "weights"
    empty.mkdir()
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    cfg = load_config_text(textwrap.dedent(f"""\
        model: m
        stages:
          - {{id: 0, name: a, model: {empty}, output: text}}
          - {{id: 1, name: b, model: {weights_only}, tokenizer: {weights_only}, inputs: [0],
             input_processor: hidden_to_embeds, output: tokens}}
        """))
    assert missing_paths(cfg, "x.yaml") == [
        f"x.yaml: stage 0 (a): model: {empty} holds no config.json / params.json: not a checkpoint directory",
        f"x.yaml: stage 1 (b): tokenizer: {weights_only} holds no tokenizer_config.json / tokenizer.json / "
        "tokenizer.model / vocab.json: not a tokenizer directory"]
    cfg.stages[0].model = str(MODELS / "tiny-qwen2_5-omni")
    cfg.stages[1].tokenizer = str(MODELS / "tiny-qwen2_5-omni")
    assert missing_paths(cfg, "x.yaml") == []
    # A stage process started alone (its own container) checks its own paths before anything else.
    path = tmp_path / "alone.yaml"
    path.write_text(f"model: m\nstages:\n  - {{id: 0, name: a, model: {empty}, output: text}}\n")
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "stage", "--config", str(path), "--stage", "0",
                           "--runtime-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"stage 0 (a): model: {empty} holds no config.json / params.json: "
                                   "not a checkpoint directory")


def test_check_rejects_generator_args_the_generator_does_not_take(tmp_path):
    path = tmp_path / "args.yaml"
    path.write_text(textwrap.dedent("""\
        model: m
        stages:
          - {id: 0, name: a, model: x, output: text}
          - {id: 1, name: t2w, kind: generation, model: x, generator: qwen2_5_omni.token2wav, inputs: [0],
             input_processor: qwen2_5_omni.talker_to_token2wav, output: audio,
             generator_args: {chunk_frames: 72, tf_32: true}}
        """))
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "check", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()[1:]
    assert line.startswith(f"{path}: stage 1 (t2w): generator_args: 'tf_32' not taken by generator "
                           "'qwen2_5_omni.token2wav' (it takes: chunk_frames, compile, compile_vocoder, cuda_graphs,")
    assert "tf32" in line and "vocoder_context_frames" in line


def test_check_rejects_generator_arg_values_their_annotation_refuses():
    """A value of the wrong type or outside a Literal's choices (a typo like `tritonn`): `check`
    names it, read from the generator's signature (its module is not imported), instead of the stage
    failing after loading its weights."""
    from omni_server.stage.generators import argument_problems

    args = {"chunk_frames": "abc", "first_chunk_frames": [24, "x"], "compile_vocoder": "tritonn",
            "dit_attention": "foo", "tf32": 1, "max_graphs": True,
            # (values that fit: none of these is reported)
            "future_frames": 24, "compile": "blocks", "dit_graph": "step", "past_frames": None,
            "dit_dtype": "bfloat16", "device": "cuda"}
    assert argument_problems("qwen2_5_omni.token2wav", args) == [
        "chunk_frames: 'abc' is not int", "first_chunk_frames: [24, 'x'] is not int | list[int] | None",
        "compile_vocoder: 'tritonn' is not bool | Literal['activations', 'triton']",
        "dit_attention: 'foo' is not Literal['cudnn', 'efficient', 'flash', 'math'] | None",
        "tf32: 1 is not bool", "max_graphs: True is not int"]
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "check", "configs/qwen2_5_omni.yaml",
                           "--stage-arg", "token2wav.generator_args.dit_graph=steps"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("configs/qwen2_5_omni.yaml: stage 2 (token2wav): generator_args.dit_graph: 'steps' is not "
            "Literal['solve', 'step']") in proc.stderr.splitlines()


def test_shipped_code2wav_windows_end_where_the_talker_sends():
    """configs/qwen3_omni.yaml: every code2wav window ends on a multiple of `stream_chunk`, so the
    talker sends a window's last frame in the step that made it (else the small first windows,
    there for early first audio, would wait for a later chunk)."""
    from omni_server.models.windows import window_at

    stage = load_config(REPO / "configs" / "qwen3_omni.yaml").stage(2)
    args = stage.generator_args
    first, chunk = tuple(args["first_chunk_frames"]), args["chunk_frames"]
    ends, end = [], 0
    for _ in range(8):
        end += window_at(end, first, chunk)
        ends.append(end)
    assert ends[:4] == [5, 15, 35, 60]
    assert all(e % stage.stream_chunk == 0 for e in ends)


def test_transcription_language_prompt_takes_only_the_language_field():
    from pydantic import ValidationError

    from omni_server.config.schema import ServerConfig

    assert ServerConfig(transcription_language_prompt="Write down the {language} speech.")
    for bad in ("Transcribe {lang} audio.", "Transcribe {0}.", "Transcribe {language"):
        with pytest.raises(ValidationError, match="may hold {language}"):
            ServerConfig(transcription_language_prompt=bad)


def test_serve_refuses_a_port_out_of_range_before_starting_anything():
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "serve", "configs/default.yaml", "--port", "70000"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "a TCP port is 0-65535, got '70000'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_setup_refuses_an_unknown_device(tmp_path):
    """`OMNI_DEVICE` other than cpu / cuda (say `gpu`) is refused, not taken for the CPU stack."""
    import os

    proc = subprocess.run(["bash", "scripts/setup-env.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMNI_DEVICE": "gpu", "VENV": str(tmp_path / "venv")})
    assert proc.returncode == 2 and "OMNI_DEVICE must be cpu or cuda, got 'gpu'" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_yaml_merge_keys_may_be_overridden():
    """`<<: *anchor` then a key of its own: the own value wins (YAML's merge), not a duplicate;
    a key given twice by hand still is one."""
    from omni_server.config import load_config_text

    text = textwrap.dedent("""\
        model: m
        stages:
          - {id: 0, name: a, model: x, output: text, engine_args: &args {dtype: float32, max_model_len: 2048}}
          - {id: 1, name: b, model: x, inputs: [0], input_processor: hidden_to_embeds, output: tokens,
             engine_args: {<<: *args, max_model_len: 4096}}
        """)
    assert load_config_text(text).stage(1).engine_args == {"dtype": "float32", "max_model_len": 4096}
    with pytest.raises(ConfigError, match="duplicate key 'max_model_len'"):
        load_config_text(text.replace("max_model_len: 4096}", "max_model_len: 4096, max_model_len: 1}"))


def test_an_override_changes_only_its_stage_when_stages_share_an_anchor():
    """`engine_args: *args` in two stages loads as one shared mapping: an override of one stage's
    must not change the other's."""
    from omni_server.config import load_config_text

    text = textwrap.dedent("""\
        model: m
        stages:
          - {id: 0, name: a, model: x, output: text, engine_args: &args {max_num_seqs: 8}, env: &env {A: "1"}}
          - {id: 1, name: b, model: x, inputs: [0], input_processor: hidden_to_embeds, output: tokens,
             engine_args: *args, env: *env}
        """)
    cfg = load_config_text(text, overrides=["a.max_num_seqs=2", "b.env.A=2"])
    assert cfg.stage(0).engine_args == {"max_num_seqs": 2} and cfg.stage(1).engine_args == {"max_num_seqs": 8}
    assert cfg.stage(0).env == {"A": "1"} and cfg.stage(1).env == {"A": "2"}


def test_an_override_that_names_no_field_is_an_argument_of_the_stages_engine_or_generator():
    from omni_server.config import load_config

    cfg = load_config(REPO / "configs" / "default.yaml", ["token2wav.chunk_frames=144", "thinker.max_num_seqs=4",
                                                          "token2wav.generator_args.past_frames=24"])
    assert cfg.stage(2).generator_args["chunk_frames"] == 144 and cfg.stage(2).generator_args["past_frames"] == 24
    assert cfg.stage(0).engine_args["max_num_seqs"] == 4 and "chunk_frames" not in cfg.stage(2).engine_args


def test_env_values_are_the_text_written():
    """YAML would read `1.10` as 1.1, `010` as 8, `0x1F` as 31 and `yes` as true: an environment
    value is the text as written, in the file (aliases too) and in --stage-arg."""
    from omni_server.config import load_config_text

    text = textwrap.dedent("""\
        model: m
        stages:
          - {id: 0, name: a, model: x, output: text, env: &e {A: 1.10, B: 010, C: yes, D: 0x1F, E: "q", F: 4}}
          - {id: 1, name: b, model: x, inputs: [0], input_processor: hidden_to_embeds, output: tokens, env: *e}
        """)
    cfg = load_config_text(text, overrides=["a.env.G=1.10", "b.env.H=007"])
    written = {"A": "1.10", "B": "010", "C": "yes", "D": "0x1F", "E": "q", "F": "4"}
    assert cfg.stage(0).env == {**written, "G": "1.10"} and cfg.stage(1).env == {**written, "H": "007"}
    cfg = load_config_text(text, overrides=["b.env={X: 1.10, Y: 010, Z: on}"])
    assert cfg.stage(1).env == {"X": "1.10", "Y": "010", "Z": "on"} and cfg.stage(0).env == written
    from omni_server.config.loader import ConfigError

    with pytest.raises(ConfigError, match="duplicate"):  # (as in the file: not the first or last silently)
        load_config_text(text, overrides=["b.env={X: 1, X: 2}"])


def test_a_tcp_port_past_65535_is_refused():
    """(ZMQ would bind it modulo 65536: tcp://127.0.0.1:99999 listened on 34463.)"""
    from omni_server.config import load_config_text

    text = VALID.replace("model: ", "model: ", 1)
    with pytest.raises(ConfigError, match=r"port 1-65535"):
        load_config_text(text, overrides=["0.address=tcp://127.0.0.1:99999"])
    assert load_config_text(text, overrides=["0.address=tcp://127.0.0.1:65535"]).stage(0).address.endswith(":65535")


def test_check_names_engine_args_vllm_does_not_take():
    """A typo or the CLI's dashed spelling in `engine_args` (here through --stage-arg): `check`
    says which, with vLLM's closest names, instead of the stage failing at start."""
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "check", "configs/default.yaml",
                           "--stage-arg", "thinker.max-num-seqs=4", "--stage-arg", "talker.engine_args.max_num_seq=2",
                           "--stage-arg", "talker.temperature=0.5"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("configs/default.yaml")]
    assert lines == [
        "configs/default.yaml: stage 0 (thinker): engine_args: vLLM takes no 'max-num-seqs' (did you mean "
        "max_num_seqs, max_num_scheduled_tokens?)",
        "configs/default.yaml: stage 1 (talker): engine_args: vLLM takes no 'max_num_seq' (did you mean "
        "max_num_seqs?)",
        # (a sampling option where the engine's go: pointed to its place)
        "configs/default.yaml: stage 1 (talker): engine_args: vLLM takes no 'temperature' (a sampling default: "
        "talker.default_sampling.temperature)"], proc.stderr


def test_check_names_engine_args_values_of_the_wrong_type():
    """EngineArgs takes values as they are: `max_num_seqs: abc` passed `check` and failed the stage's
    start with a TypeError naming no field; a number written as a string the same, and counts below
    1 (`max_model_len: -5`; -1 is vLLM's fit-to-memory) or a memory fraction above 1."""
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "check", "configs/default.yaml",
                           "--stage-arg", "thinker.max_num_seqs=abc", "--stage-arg", "talker.max_model_len='512'",
                           "--stage-arg", "thinker.compilation_config=fast", "--stage-arg", "thinker.max_model_len=-5",
                           "--stage-arg", "talker.gpu_memory_utilization=1.5", "--stage-arg", "talker.max_num_batched_tokens=0"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = sorted(line for line in proc.stderr.splitlines() if line.startswith("configs/default.yaml"))
    assert lines[0].startswith("configs/default.yaml: stage 0 (thinker): engine_args.compilation_config: 'fast': ")
    assert lines[1:] == [
        "configs/default.yaml: stage 0 (thinker): engine_args.max_model_len: -5 must be at least 1 (or -1)",
        "configs/default.yaml: stage 0 (thinker): engine_args.max_num_seqs: 'abc': Input should be a valid integer, "
        "unable to parse string as an integer",
        "configs/default.yaml: stage 1 (talker): engine_args.gpu_memory_utilization: 1.5 must be above 0 and at most 1 "
        "(a fraction of the GPU's memory)",
        "configs/default.yaml: stage 1 (talker): engine_args.max_model_len: '512' is a string; write it as int (512)",
        "configs/default.yaml: stage 1 (talker): engine_args.max_num_batched_tokens: 0 must be at least 1"], \
        proc.stderr


def test_stage_args_take_lists_and_check_devices_and_addresses():
    """--stage-arg reads a flow list as the file does (devices=[0,1] is "0,1", one address per
    replica); devices must be what CUDA_VISIBLE_DEVICES takes, addresses ZMQ endpoints."""
    from omni_server.config import load_config

    cfg = load_config(REPO / "configs" / "default.yaml", [
        "thinker.devices=[0,1]", "0.replicas=2", "0.address=[tcp://127.0.0.1:7001, tcp://127.0.0.1:7002]",
        "talker.devices=GPU-8f3a,1"])
    assert cfg.stage(0).devices == "0,1" and cfg.stage(1).devices == "GPU-8f3a,1"
    assert cfg.stage(0).address == ["tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"]
    with pytest.raises(ConfigError, match="replica_devices.*got 'cuda:1'"):  # (each replica's too)
        load_config(REPO / "configs" / "default.yaml", ["0.replicas=2", "0.replica_devices=[0, cuda:1]"])
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "default.yaml", ["thinker.devices=gpu0", "talker.address=localhost:7002"])
    where = REPO / "configs" / "default.yaml"
    assert _problems(err) == [
        f"{where}: stage 0 (thinker): devices: GPU indices or UUIDs, one or comma-separated (e.g. 0 or 0,1), got "
        "'gpu0'", f"{where}: stage 1 (talker): address: a ZMQ address tcp://HOST:PORT (port 1-65535) or ipc://PATH, got 'localhost:7002'"]


def test_serve_says_when_it_cannot_make_its_runtime_dir(tmp_path):
    path = tmp_path / "rd.yaml"
    path.write_text("model: m\nruntime_dir: /proc/omni-server\nstages:\n  - {id: 0, name: a, model: x, output: text}\n")
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "serve", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "runtime_dir /proc/omni-server: cannot create it: No such file or directory" in proc.stderr


def test_an_ipc_address_past_zmqs_path_limit_is_refused_at_load(tmp_path):
    """Not a config that validates and then fails when the stage binds."""
    import zmq

    from omni_server.config import ConfigError, load_config_text

    ok = "ipc:///tmp/" + "a" * (zmq.IPC_PATH_MAX_LEN - 5)
    text = "model: m\nstages:\n  - {id: 0, name: a, model: x, output: text, address: '%s'}\n"
    assert load_config_text(text % ok).stage(0).address == ok
    with pytest.raises(ConfigError, match=f"ipc path of {zmq.IPC_PATH_MAX_LEN + 1} characters, at most"):
        load_config_text(text % (ok + "a"))


@pytest.mark.parametrize("level, ok", [("debug", True), ("Warning", True), ("bogus", False)])
def test_omni_log_level_takes_any_case_and_a_bad_one_is_one_line(tmp_path, level, ok):
    """OMNI_LOG_LEVEL=debug failed every command with a traceback (logging takes upper case only)."""
    import os

    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "keys", str(tmp_path / "k")], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMNI_LOG_LEVEL": level})
    if ok:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("OMNI_LOG_LEVEL='bogus': expected debug")


def test_check_and_serve_name_a_runtime_dir_serve_would_refuse(tmp_path):
    """`check` said ok to a runtime_dir that `serve` then refused (others may write in it, or it is a
    file); a private one, or one still to be made, is fine."""
    import os

    from omni_server.config.loader import missing_paths

    def problems(runtime_dir) -> list[str]:
        cfg = load_config_text(f"model: m\nruntime_dir: {runtime_dir}\nstages:\n  - {{id: 0, name: a, model: x, output: text}}\n")
        return missing_paths(cfg, "c.yaml")

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    assert problems(shared) == [] and problems(tmp_path / "new" / "rt") == []
    shared.chmod(0o777)
    assert problems(shared) == [f"c.yaml: runtime_dir: {shared} must be owned by this user and writable by no one "
                                f"else (owner uid {os.getuid()}, mode 0o777)"]
    (tmp_path / "f").write_text("")
    assert problems(tmp_path / "f") == [f"c.yaml: runtime_dir: {tmp_path / 'f'} is not a directory"]


@pytest.mark.parametrize("config", ["configs/default.yaml", "configs/qwen2_5_omni.yaml", "configs/qwen2_5_omni_2gpu.yaml",
                                    "configs/qwen2_5_omni_tp2.yaml", "configs/qwen3_omni.yaml",
                                    "docker/pipeline.yaml", "tests/configs/qwen3_omni.yaml"])
def test_shipped_talkers_hold_their_thinkers_longest_prompt_and_max_tokens(config):
    """A talker's context must hold the thinker's longest prompt, the rows its processor adds and its
    max_tokens: at 2048 beside a 2048 thinker a 2034-token chat's speech came out 4 frames short, a
    2040-token one failed once the text had begun. `check` names such a stage."""
    from omni_server.stage.processors import context_notes

    assert context_notes(load_config(REPO / config)) == []
    (note,) = context_notes(load_config(REPO / config, ["talker.max_model_len=2048"] if "tests" in config or "default" in config
                                        else ["talker.max_model_len=12288"]))
    rows = 9 if "qwen3" in config else 2
    assert note.startswith(f"stage 1 (talker): max_model_len {2048 if 'tests' in config or 'default' in config else 12288} "
                           f"cannot hold the longest prompt stage 0 (thinker) takes") and f"plus the {rows} rows" in note
