"""Stage start order: engines sharing a GPU start one after another, others at once."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_server.config import load_config, load_config_text
from omni_server.orchestrator.launcher import Launcher
from tests.conftest import REPO

CONFIG = """
model: m
stages:
  - {id: 0, name: a, model: x, output: text}
  - {id: 1, name: b, model: x, devices: "1", inputs: [0], input_processor: hidden_to_embeds}
  - {id: 2, name: c, model: x, devices: "0,1", inputs: [1], input_processor: hidden_to_embeds}
  - {id: 3, name: d, model: x, devices: "2", inputs: [2], input_processor: hidden_to_embeds,
     replicas: 3, replica_devices: [2, 3, 2]}
"""


def _launcher(sequential: bool) -> Launcher:
    launcher = Launcher(load_config_text(CONFIG), Path("/tmp"))
    launcher.sequential = sequential
    return launcher


def test_gpu_host_waits_for_earlier_stages_on_overlapping_devices():
    launcher = _launcher(True)
    assert launcher.start_after((0, 0)) == []
    assert launcher.start_after((1, 0)) == [(0, 0)]  # stage 0 has no devices set: it may use every GPU
    assert launcher.start_after((2, 0)) == [(0, 0), (1, 0)]
    # Replicas on their own GPUs start together; one sharing a GPU waits for the earlier one there.
    assert launcher.start_after((3, 0)) == [(0, 0)]
    assert launcher.start_after((3, 1)) == [(0, 0)]
    assert launcher.start_after((3, 2)) == [(0, 0), (3, 0)]


SIZED = """
model: m
stages:
  - {id: 0, name: thinker, model: x, devices: "0", output: text, engine_args: {kv_cache_memory_bytes: 1000000}}
  - {id: 1, name: talker, model: x, devices: "0", inputs: [0], input_processor: hidden_to_embeds,
     engine_args: {kv_cache_memory_bytes: 1000000}}
  - {id: 2, name: voc, kind: generation, generator: qwen2_5_omni.token2wav, model: x, devices: "0", inputs: [1],
     input_processor: qwen2_5_omni.talker_to_token2wav, output: audio}
  - {id: 3, name: late, model: x, devices: "0", inputs: [1], input_processor: hidden_to_embeds}
"""


def test_engines_with_a_fixed_kv_size_share_a_gpu_from_the_start():
    # Given kv_cache_memory_bytes, vLLM does not measure memory while starting: such engines and
    # generation stages build side by side; an engine that profiles still starts alone.
    launcher = Launcher(load_config_text(SIZED), Path("/tmp"))
    launcher.sequential = True
    assert [launcher.start_after(u) for u in launcher.cfg.units()] == [[], [], [], [(0, 0), (1, 0), (2, 0)]]


@pytest.mark.parametrize("path", ["configs/default.yaml", "configs/qwen2_5_omni.yaml", "configs/qwen3_omni.yaml",
                                  "docker/pipeline.yaml"])
def test_shipped_one_gpu_pipelines_build_every_stage_at_once(path):
    """Their engines have fixed KV sizes: nothing waits for another stage's start (the Qwen3 config
    profiled memory until 2026-12-01 and took 100 s + 94 s instead of the longer of the two)."""
    launcher = Launcher(load_config(REPO / path), Path("/tmp"))
    launcher.sequential = True
    assert all(launcher.start_after(u) == [] for u in launcher.cfg.units())


ONE_GPU = """
model: m
stages:
  - {id: 0, name: thinker, model: x, devices: "0", output: text}
  - {id: 1, name: talker, model: x, devices: "0", inputs: [0], input_processor: hidden_to_embeds}
  - {id: 2, name: voc, kind: generation, generator: qwen2_5_omni.token2wav, model: x, devices: "0", inputs: [1],
     input_processor: qwen2_5_omni.talker_to_token2wav, output: audio}
"""


def test_a_generation_stage_builds_before_the_engines_that_profile_its_gpu():
    # A one-GPU speech pipeline whose engines profile memory: token2wav (CUDA graph capture, ~20 s
    # on the H200) builds first, while thinker and talker import; they then profile with its memory
    # already in use. (configs/qwen2_5_omni.yaml gives both engines KV sizes: all three build at once.)
    launcher = Launcher(load_config_text(ONE_GPU), Path("/tmp"))
    launcher.sequential = True
    assert launcher.build_order() == [(2, 0), (0, 0), (1, 0)]
    assert [launcher.start_after(u) for u in launcher.cfg.units()] == [[(2, 0)], [(2, 0), (0, 0)], []]


def test_cpu_host_starts_everything_at_once():
    launcher = _launcher(False)
    assert [launcher.start_after(u) for u in launcher.cfg.units()] == [[]] * 6


class _StageLog:
    """Stage processes' stderr in a file they append to. (Reading pytest's fd capture while a child
    writes can drop the child's line: readouterr reads, then truncates the shared file.)"""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def start(self, launcher: Launcher, unit, hold: bool) -> None:
        saved = os.dup(2)
        os.dup2(self.fd, 2)  # the child inherits fd 2
        try:
            launcher.start(unit, hold=hold)
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text():
            assert time.monotonic() < deadline, f"no {text!r} in {timeout:.0f} s; stage output:\n{self.text()[-4000:]}"
            time.sleep(0.2)


def test_held_stage_imports_then_builds_its_engine_only_when_released(tiny_models, tmp_path):
    # A real stage process (token2wav of the default pipeline): held, it gets as far as its imports
    # and waits; released, it builds its generator and reports ready; EOF without "go" ends it.
    cfg_path = str(REPO / "configs" / "default.yaml")
    launcher = Launcher(load_config(cfg_path), tmp_path)
    held, dropped = (2, 0), (1, 0)
    out = _StageLog(tmp_path / "stages.log")
    out.start(launcher, held, hold=True)
    out.start(launcher, dropped, hold=True)
    try:
        out.wait_for("stage 2 (token2wav) imported; waiting")
        time.sleep(2.0)
        assert "stage 2 (token2wav) ready in" not in out.text()
        assert launcher.exited() == {}
        launcher.release(held)
        out.wait_for("stage 2 (token2wav) ready in")
        out.wait_for("stage 1 (talker) imported; waiting")
        launcher.procs[dropped].stdin.close()  # the server went away before releasing it
        assert launcher.procs[dropped].wait(60) == 0
        assert "stage 1 (talker): no go from the server; exiting" in out.text()
    finally:
        launcher.stop_all()
        os.close(out.fd)
    assert launcher.procs[held].returncode is not None


def test_stage_devices_index_the_gpus_serve_sees():
    from omni_server.stage.main import visible_devices

    assert visible_devices("0", None) == "0" and visible_devices("1,0", "") == "1,0"
    assert visible_devices("0", "2,3") == "2" and visible_devices("1,0", "2, 3") == "3,2"
    assert visible_devices("GPU-abc", "2,3") == "GPU-abc"  # a UUID is taken as given
    with pytest.raises(SystemExit, match="GPU 2 is not among the 2 visible"):
        visible_devices("2", "4,5")


def test_server_that_cannot_start_a_stage_says_why(tiny_models, tmp_path):
    # A real `serve` whose token2wav checkpoint is a folder no model loads from: it exits 1, and its
    # last line names the stage and the stage's own exception (not only an exit code).
    from tests.conftest import Server

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")  # (without one, serve refuses the folder before any stage starts)
    server = Server(REPO / "configs" / "default.yaml", tmp_path / "serve.log",
                    args=["--stage-arg", f"token2wav.model={empty}"])
    try:
        assert server.proc.wait(240) == 1
    finally:
        server.stop()
    last = server.log_tail().splitlines()[-1]
    assert "stage 2 (token2wav) failed to start (exit code 1): ValueError: Unrecognized model in " + str(empty) in last


def test_a_port_in_use_or_a_host_that_does_not_resolve_stops_serve_before_any_stage_starts(tiny_models, tmp_path):
    """The api's port is bound before the stages launch: a port in use (or a bad host) was uvicorn's
    error after every stage had started (~20 s), not its last line, with exit code 3."""
    import socket

    from tests.conftest import Server

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        server = Server(REPO / "configs" / "default.yaml", tmp_path / "serve.log",
                        args=["--port", str(held.getsockname()[1])])  # (the later --port wins)
        try:
            assert server.proc.wait(60) == 1
        finally:
            server.stop()
        log = server.log_tail()
        assert log.splitlines()[-1] == f"cannot listen on 127.0.0.1:{held.getsockname()[1]}: Address already in use"
        assert "starting, pid" not in log  # (no stage launched)
        server = Server(REPO / "configs" / "default.yaml", tmp_path / "host.log", args=["--host", "no-such-host.invalid"])
        try:
            assert server.proc.wait(60) == 1
        finally:
            server.stop()
        assert server.log_tail().splitlines()[-1].startswith("cannot listen on no-such-host.invalid:")
    finally:
        held.close()


def test_an_output_address_in_use_or_bad_curve_keys_stop_serve_before_any_stage_starts(tiny_models, tmp_path):
    """The api's ZMQ set-up is tried before the stages launch: its output address in use, or CURVE
    keys that do not load, were uvicorn's traceback (exit code 3) after every stage had started."""
    import socket

    from tests.conftest import Server

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    base = (REPO / "configs" / "default.yaml").read_text().replace("../var/models", str(REPO / "var/models"))
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "omni.key_secret").write_text("not a key\n")
    try:
        for name, server_cfg, says in (
                ("busy", f"{{output_address: 'tcp://127.0.0.1:{held.getsockname()[1]}'}}",
                 f"cannot listen on tcp://127.0.0.1:{held.getsockname()[1]} (the api's output address): "
                 "Address already in use"),
                ("keys", f"{{curve_keys_dir: {keys}}}", f"server.curve_keys_dir: {keys}: ")):
            config = tmp_path / f"{name}.yaml"
            config.write_text(base + f"\nserver: {server_cfg}\nruntime_dir: {tmp_path / name}\n")
            server = Server(config, tmp_path / f"{name}.log", args=["--port", "0"])
            try:
                assert server.proc.wait(60) == 1
            finally:
                server.stop()
            log = server.log_tail()
            assert log.splitlines()[-1].startswith(says), log
            assert "starting, pid" not in log and "Traceback" not in log  # (no stage launched)
    finally:
        held.close()


def test_failure_note_of_a_stage_process():
    from omni_server.orchestrator.launcher import failure_note

    assert failure_note(SystemExit(0)) is None and failure_note(SystemExit(None)) is None
    assert failure_note(KeyboardInterrupt()) is None
    assert failure_note(SystemExit("devices '2': GPU 2 is not among the 1 visible")) == \
        "devices '2': GPU 2 is not among the 1 visible"
    assert failure_note(SystemExit(3)) == "exit code 3"
    assert failure_note(RuntimeError("CUDA out of memory.\n  Tried to allocate 2 GiB")) == \
        "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"
    assert failure_note(MemoryError()) == "MemoryError"


def test_check_explains_which_stages_build_one_after_another():
    """`omni-server check` notes the stages that wait for others on a GPU host, and why (on any
    host: the note is about the deployment, not this machine)."""
    import torch

    launcher = Launcher(load_config_text(SIZED), Path("/tmp"))
    launcher.sequential = False
    (note,) = launcher.gpu_start_notes()
    assert note.startswith("stage 3 (late) builds after thinker, talker, voc on a GPU host: its engine measures")
    assert "kv_cache_memory_bytes" in note and launcher.sequential is False
    notes = Launcher(load_config_text(ONE_GPU), Path("/tmp")).gpu_start_notes()
    assert notes == ["stage 0 (thinker) builds after voc on a GPU host: its engine measures free GPU memory while "
                     "it starts; `kv_cache_memory_bytes` in its engine_args lets it build beside them",
                     "stage 1 (talker) builds after voc, thinker on a GPU host: its engine measures free GPU memory "
                     "while it starts; `kv_cache_memory_bytes` in its engine_args lets it build beside them"]
    def check(name: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "check", str(REPO / "configs" / name)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        notes = proc.stdout.splitlines()[1:]
        # (the configs name GPUs: a host without one is told so, once)
        gpu_less = [n for n in notes if n.startswith("note: no CUDA device is visible here")]
        assert len(gpu_less) == (not torch.cuda.is_available())
        return [n for n in notes if n not in gpu_less]

    (note,) = check("qwen2_5_omni_2gpu.yaml")  # the talker on GPU 1 sizes its KV cache from what token2wav left
    assert note.startswith("note: stage 1 (talker) builds after token2wav on a GPU host")
    # (its fixed KV sizes: every stage builds at once; the one other note a host may get is about
    # the MPS program, `cuda_mps: auto`)
    assert [n for n in check("qwen3_omni.yaml") if "cuda_mps" not in n] == []


def test_serve_stops_its_stages_when_the_api_cannot_start(tmp_path, monkeypatch, tiny_models, caplog):
    """`serve` starts the stage processes before its own set-up; when that set-up fails (here the
    text stage's tokenizer does not exist), no stage process is left running and serve ends with
    one line naming stage 0 and why (exit 1, not transformers' traceback)."""
    import asyncio

    from omni_server.server import serve
    from tests.conftest import free_port

    cfg = load_config(REPO / "configs" / "default.yaml")
    cfg.stage(0).tokenizer = str(tmp_path / "no-such-tokenizer")
    cfg.server.port, cfg.runtime_dir = free_port(), str(tmp_path / "run")
    started = []
    start = Launcher.start

    def recording_start(self, unit, hold=False):  # (the real start, remembering each process)
        start(self, unit, hold)
        started.append(self.procs[unit])

    monkeypatch.setattr(Launcher, "start", recording_start)
    with caplog.at_level(logging.ERROR):
        assert asyncio.run(serve(cfg)) == 1
    assert len(started) == len(cfg.units()) == 3
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.name == "omni_server.server"]
    assert error.startswith(f"stage 0 (thinker): the api cannot load its tokenizer from '{tmp_path}/no-such-tokenizer': ")
    assert all(p.poll() is not None for p in started)  # stopped, and waited for


def _serve_default(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """`serve configs/default.yaml` on a free port, its output in tmp_path/serve.log."""
    from tests.conftest import free_port

    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "omni_server.cli", "serve", "configs/default.yaml", "--port",
                                 str(free_port())], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_while_the_stages_start_stops_everything_cleanly(tiny_models, tmp_path, sig):
    """Ctrl-C or SIGTERM in the seconds before the api serves (stages launched, the api setting
    up): `serve` stops its stages and exits 0 without a traceback, as it does once serving."""
    import psutil

    proc, log = _serve_default(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while "stage 2 (token2wav) starting" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        stages = [c.pid for c in psutil.Process(proc.pid).children()]
        proc.send_signal(getattr(signal, sig))
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still running 60 s after {sig}:\n{log.read_text()[-3000:]}")
        assert code == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    as_ = "SIGTERM" if sig == "SIGHUP" else sig  # (the terminal closing stops serve as SIGTERM does)
    assert f"{as_} while starting: stopping the stages" in text and "Traceback" not in text, text[-3000:]
    assert len(stages) == 3 and not [p for p in stages if psutil.pid_exists(p)
                                     and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_before_any_stage_starts_ends_serve_quietly(tiny_models, tmp_path, sig):
    """Ctrl-C or SIGTERM in the first seconds (the config's checks, the imports), before serve's own
    handlers: exit 0 with no traceback, as later (Ctrl-C was a KeyboardInterrupt traceback, SIGTERM
    a death by signal)."""
    proc, log = _serve_default(tmp_path)
    try:
        # Once the command catches SIGTERM (its first step), before any stage: /proc says which it catches.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            caught = next(line for line in open(f"/proc/{proc.pid}/status") if line.startswith("SigCgt:"))
            if int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
                break
            time.sleep(0.005)
        proc.send_signal(getattr(signal, sig))
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 0 and "Traceback" not in text and "starting, pid" not in text, text[-3000:]


def test_a_runtime_dir_serves_one_serve_at_a_time(tmp_path):
    """A second `serve` on the same runtime_dir would bind the first one's ipc sockets (ZMQ lets it)
    and take them over silently: it is refused, and the directory is free again once released. A
    directory others can write in is refused too."""
    from omni_server.config import load_config_text
    from omni_server.wire import transport

    cfg = load_config_text(f"model: m\nruntime_dir: {tmp_path / 'rt'}\nstages:\n  - {{id: 0, name: a, model: x, output: text}}\n")
    assert transport.make_runtime_dir(cfg) == tmp_path / "rt"
    with pytest.raises(SystemExit, match="in use by another `omni-server serve`"):
        transport.make_runtime_dir(cfg)
    transport._locks.pop().close()
    assert transport.make_runtime_dir(cfg) == tmp_path / "rt"
    transport._locks.pop().close()
    # One others may write in is refused (another user could replace its sockets).
    (tmp_path / "rt").chmod(0o777)
    (tmp_path / "rt" / "serve.lock").unlink()
    with pytest.raises(SystemExit, match="writable by no one else .*mode 0o777"):
        transport.make_runtime_dir(cfg)
    assert not (tmp_path / "rt" / "serve.lock").exists()  # (refused before writing anything there)


def test_each_stage_has_its_own_startup_timeout_and_port_0_logs_the_port_bound(tiny_models, tmp_path):
    """A stage's startup_timeout_s is its own (the largest, token2wav's 600 s, applied to all), and
    the ready line names the port `--port 0` got, not 0."""
    import re

    import httpx

    from tests.conftest import Server

    late = Server(REPO / "tests" / "configs" / "text.yaml", tmp_path / "late.log",
                  args=["--stage-arg", "thinker.startup_timeout_s=0.5"])
    try:
        assert late.proc.wait(120) != 0
    finally:
        late.stop()
    assert "stages not ready in time: thinker (" in late.log_tail() and "startup_timeout_s 0.5)" in late.log_tail()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "omni_server.cli", "serve", "tests/configs/text.yaml", "--port",
                                 "0"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, m = time.monotonic() + 180, None
        while m is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            m = re.search(r"serving on http://127\.0\.0\.1:(\d+)", log.read_text())
        assert m is not None and int(m.group(1)) != 0, log.read_text()[-3000:]
        assert httpx.get(f"http://127.0.0.1:{m.group(1)}/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(2)
        proc.wait(60)


@pytest.mark.parametrize("arg, says", [
    # (it failed every request instead, as the client's bad logit_bias: a 400 for a field never sent)
    ("thinker.default_sampling.suppress_token_ids=[5, 99999999]",
     "default_sampling.suppress_token_ids: [99999999] not in the model's vocabulary (0-1279)"),
    # (EngineArgs took it as it was: a TypeError deep in the engine's start, naming no field; the stage
    # checks its own engine_args first, as `check` does)
    ("thinker.max_num_seqs=abc", "engine_args.max_num_seqs: 'abc': Input should be a valid integer"),
], ids=["token-id-past-the-vocabulary", "engine-arg-of-the-wrong-type"])
def test_a_bad_stage_setting_fails_the_stage_start_naming_it(tiny_models, tmp_path, arg, says):
    from tests.conftest import Server

    server = Server(REPO / "tests" / "configs" / "text.yaml", tmp_path / "serve.log", args=["--stage-arg", arg])
    try:
        assert server.proc.wait(240) == 1
    finally:
        server.stop()
    assert f"stage 0 (thinker) failed to start (exit code 1): ValueError: stage 0 (thinker): {says}" in server.log_tail()


def test_a_restarted_stage_runs_the_config_serve_read(tiny_models, tmp_path):
    """Stages start from serve's validated config (overrides applied), not from the file again: a
    stage restarted after the file was moved away (or edited) runs as before."""
    import httpx

    from tests.conftest import Server

    text = (REPO / "tests" / "configs" / "text.yaml").read_text()
    config = tmp_path / "pipeline.yaml"
    config.write_text(text.replace("../../var/models/", str(REPO / "var" / "models") + "/")
                      .replace("chat_template: tools_template.jinja", f"chat_template: {REPO}/tests/configs/tools_template.jinja"))
    server = Server(config, tmp_path / "serve.log", args=["--stage-arg", "thinker.default_sampling.max_tokens=3"])
    try:
        server.wait_ready(time.monotonic() + 180)
        config.unlink()
        pid = httpx.get(f"{server.base_url}/health").json()["pids"]["thinker"]
        os.kill(pid, signal.SIGKILL)
        deadline, health = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            health = httpx.get(f"{server.base_url}/health")
            if health.status_code == 200 and health.json()["pids"]["thinker"] != pid:
                break
            time.sleep(0.5)
        assert health.status_code == 200 and health.json()["pids"]["thinker"] != pid, server.log_tail()
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                       json={"model": "omni-tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["usage"]["completion_tokens"] == 3  # (the override still applies)
    finally:
        server.stop()


_PARENT = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # exits at once, its child left running
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
while True:  # (not signal.pause(): a SIGTERM landing just before it was never handled, CI 2026-12-07)
    time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["stop_all", "kill"])
def test_what_a_stage_process_leaves_behind_is_stopped_with_it(how):
    # A stage that exits on SIGTERM (or crashes) while a child of its own (a tensor-parallel or
    # compile worker) lives on: the child must not outlive it, holding its memory.
    launcher = _launcher(sequential=False)
    unit = (0, 0)
    proc = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, start_new_session=True)
    launcher.procs[unit] = proc
    child = int(proc.stdout.readline())
    try:
        assert _alive(child)
        if how == "stop_all":
            launcher.stop_all(timeout=10)
        else:  # serve's path for a stage that exited by itself
            proc.terminate()
            proc.wait(10)
            assert _alive(child)
            launcher.kill(unit)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass
        proc.stdout.close()


def test_serve_warns_when_it_listens_beyond_the_machine_without_a_key():
    from omni_server.server import open_without_key

    assert open_without_key("0.0.0.0", None) and open_without_key("::", "") and open_without_key("api", None)
    assert not open_without_key("127.0.0.1", None) and not open_without_key("::1", None)
    assert not open_without_key("localhost", None) and not open_without_key("0.0.0.0", "sekret")


def test_a_restart_that_hangs_in_its_start_is_killed_and_restarted_again(tiny_models, tmp_path):
    """startup_timeout_s held only for the first start: a restarted stage that never got ready (hung
    in its imports, say) left its route down for good, with nothing logged. It is killed at its
    startup_timeout_s and restarted again; meanwhile /health says it is restarting."""
    import httpx
    import psutil

    from tests.conftest import Server

    server = Server(REPO / "tests" / "configs" / "text.yaml", tmp_path / "serve.log",
                    args=["--stage-arg", "thinker.startup_timeout_s=40"])
    try:
        server.wait_ready(time.monotonic() + 120)
        old = httpx.get(f"{server.base_url}/health", timeout=10).json()["pids"]["thinker"]

        def stage_pids() -> set[int]:
            """The server's stage processes (running or stopped) but the killed one."""
            out = set()
            for p in psutil.Process(server.proc.pid).children():
                try:
                    if p.pid != old and p.status() != psutil.STATUS_ZOMBIE and "--stage" in p.cmdline():
                        out.add(p.pid)
                except psutil.Error:  # (gone meanwhile)
                    pass
            return out

        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (hung := stage_pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
        (hung,) = hung
        os.kill(hung, signal.SIGSTOP)  # (its start never ends)
        health = httpx.get(f"{server.base_url}/health", timeout=10).json()
        assert health["stages"]["thinker"] == "restarting", health
        deadline = time.monotonic() + 60
        while (hung in stage_pids() or not stage_pids()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE
        assert stage_pids(), "no new start after the hung one was killed"
        assert ("stage 0 (thinker) restarted but not ready within its startup_timeout_s (40 s); killing it"
                in server.log_tail(100_000))
    finally:
        assert server.stop() == 0
