"""`cuda_mps`: serve's own MPS daemon, started when stages share a GPU, its variables in every stage
process, quit at the end. The daemon here is a stand-in program on PATH with the real one's name
(this host has no NVIDIA driver); it records how it was called. The H200 runs measured the real one."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

from omni_server.config import ConfigError, load_config_text
from omni_server.orchestrator.launcher import Launcher
from omni_server.orchestrator.mps import PROGRAM, MPSDaemon, MPSError
from tests.conftest import REPO

FAKE = """#!/bin/sh
# Records each call in the log directory the daemon is given; FAKE_MPS_FAIL makes `-d` fail.
echo "$*" >> "$CUDA_MPS_LOG_DIRECTORY/calls"
env > "$CUDA_MPS_LOG_DIRECTORY/env"
if [ "$1" = "-d" ]; then
  if [ -n "$FAKE_MPS_FAIL" ]; then echo "An instance of this daemon is already running" >&2; exit 3; fi
  exit 0
fi
cat >> "$CUDA_MPS_LOG_DIRECTORY/stdin"
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    prog = bin_dir / PROGRAM
    prog.write_text(FAKE)
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return tmp_path


def _pipeline(mps: str, devices=("0", "0")) -> str:
    return f"""
model: m
cuda_mps: {mps}
stages:
  - {{id: 0, name: a, model: x, devices: "{devices[0]}", output: text}}
  - {{id: 1, name: b, model: x, devices: "{devices[1]}", inputs: [0], input_processor: hidden_to_embeds}}
"""


def _on_gpu_host(text: str, runtime_dir: Path) -> Launcher:
    launcher = Launcher(load_config_text(text), runtime_dir)
    launcher.cuda = True  # (what this CPU host is not: the decision under test is what follows)
    return launcher


def test_daemon_starts_privately_and_quits(fake_mps, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    daemon = MPSDaemon(fake_mps / "mps")
    daemon.start()
    log_dir = fake_mps / "mps" / "log"
    assert (log_dir / "calls").read_text() == "-d\n"
    env = dict(line.split("=", 1) for line in (log_dir / "env").read_text().splitlines() if "=" in line)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(fake_mps / "mps" / "pipe")
    assert "CUDA_VISIBLE_DEVICES" not in env  # it sees the GPUs as the host numbers them
    assert stat.S_IMODE((fake_mps / "mps" / "pipe").stat().st_mode) == 0o700
    daemon.stop()
    assert (log_dir / "calls").read_text() == "-d\n\n" and (log_dir / "stdin").read_text() == "quit\n"
    daemon.stop()  # once only
    assert (log_dir / "calls").read_text() == "-d\n\n"


def test_daemon_quits_when_serve_is_killed(fake_mps):
    """A server killed outright (no `stop`) still leaves no daemon behind: its watchdog quits it."""
    import signal
    import subprocess
    import sys

    script = ("import sys, time; from pathlib import Path; from omni_server.orchestrator.mps import MPSDaemon; "
              "MPSDaemon(Path(sys.argv[1])).start(); print('up', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(fake_mps / "mps")], stdout=subprocess.PIPE, cwd=REPO)
    assert proc.stdout.readline() == b"up\n"
    stdin = fake_mps / "mps" / "log" / "stdin"
    time.sleep(1.5)
    assert not stdin.exists()  # (while the server lives, nothing quits the daemon)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while not stdin.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stdin.read_text() == "quit\n"


def test_daemon_errors_say_why(fake_mps, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with pytest.raises(MPSError, match="exited with code 3: An instance of this daemon is already running"):
        MPSDaemon(fake_mps / "mps").start()
    monkeypatch.setenv("PATH", str(fake_mps / "empty"))
    with pytest.raises(MPSError, match=f"{PROGRAM} is not on PATH"):
        MPSDaemon(fake_mps / "mps").start()


def test_stages_sharing_a_gpu_get_the_daemon(fake_mps):
    launcher = _on_gpu_host(_pipeline("true"), fake_mps)
    daemon = launcher.start_mps()
    assert daemon is not None and launcher.env == daemon.env
    assert launcher.env["CUDA_MPS_PIPE_DIRECTORY"] == str(fake_mps / "mps" / "pipe")
    daemon.stop()
    # Not when no two stages share a GPU, nor on a CPU host, nor when the config leaves it off.
    for text, cuda in ((_pipeline("true", ("0", "1")), True), (_pipeline("true"), False), (_pipeline("false"), True)):
        launcher = _on_gpu_host(text, fake_mps / "other")
        launcher.cuda = cuda
        assert launcher.start_mps() is None and launcher.env == {}
    # A stage without `devices` may use any GPU: it shares with every other.
    assert _on_gpu_host(_pipeline("true", ("0", "")).replace('devices: ""', "devices: null"), fake_mps).shares_a_gpu()


def test_auto_goes_on_without_mps_and_true_does_not(fake_mps, monkeypatch, caplog):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    launcher = _on_gpu_host(_pipeline("auto"), fake_mps)
    with caplog.at_level(logging.WARNING):
        assert launcher.start_mps() is None
    assert launcher.env == {} and "cuda_mps: auto: no MPS" in caplog.text and "already running" in caplog.text
    with pytest.raises(MPSError):
        _on_gpu_host(_pipeline("true"), fake_mps).start_mps()


def _environ_after_exec(pid: int) -> dict[bytes, bytes]:
    # Popen returns once exec passes its point of no return; the kernel sets the new image's
    # environment a moment later, so until then /proc/PID/environ reads empty.
    deadline = time.monotonic() + 10
    while not (raw := Path(f"/proc/{pid}/environ").read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def test_stage_processes_get_the_daemons_variables(fake_mps):
    launcher = _on_gpu_host(_pipeline("true"), fake_mps)
    daemon = launcher.start_mps()
    try:
        launcher.start((1, 0), hold=True)  # (it imports, then waits for `release`: never builds here)
        env = _environ_after_exec(launcher.procs[(1, 0)].pid)
        assert env[b"CUDA_MPS_PIPE_DIRECTORY"] == str(fake_mps / "mps" / "pipe").encode()
        assert env[b"PATH"] == os.environ["PATH"].encode()  # (the rest of serve's environment too)
    finally:
        launcher.stop_all(timeout=20)
        daemon.stop()


def test_cuda_mps_setting_and_check_notes(fake_mps, monkeypatch):
    with pytest.raises(ConfigError, match="cuda_mps"):
        load_config_text(_pipeline("sometimes"))
    assert _on_gpu_host(_pipeline("auto"), fake_mps).host_notes() == []  # (this host has cc; PATH has the program)
    monkeypatch.setenv("PATH", str(fake_mps / "empty"))
    monkeypatch.delenv("CC", raising=False)
    notes = _on_gpu_host(_pipeline("true"), fake_mps).host_notes()
    assert len(notes) == 2 and notes[0].startswith("no C compiler on PATH")
    assert f"cuda_mps: {PROGRAM} is not on PATH" in notes[1] and "will not start on a GPU host" in notes[1]
    monkeypatch.setenv("CC", "/opt/cc")
    assert len(_on_gpu_host(_pipeline("auto", ("0", "1")), fake_mps).host_notes()) == 0
    cpu_host = _on_gpu_host(_pipeline("false", ("0", "1")), fake_mps)
    cpu_host.cuda = False  # (stages naming GPUs, checked where none is visible)
    assert cpu_host.host_notes() == ["no CUDA device is visible here: a, b name GPUs (`devices`) and need a GPU "
                                     "host to run as configured"]


def test_check_notes_an_sm_cap_without_serves_mps(fake_mps):
    # A stage's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the 7B configs cap the thinker and talker) does
    # nothing where serve starts no MPS daemon: cuda_mps off, or no two stages on one GPU.
    for mps, devices, noted in (("auto", ("0", "0"), False), ("false", ("0", "0"), True), ("auto", ("0", "1"), True)):
        capped = _pipeline(mps, devices).replace("output: text}", "output: text, env: {CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: 50}}")
        notes = _on_gpu_host(capped, fake_mps).host_notes()
        assert any("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in the env of a caps" in n for n in notes) == noted, (mps, devices)
    assert _on_gpu_host(_pipeline("false"), fake_mps).host_notes() == []  # (no cap, nothing to say)


def test_serve_flag_overrides_the_configs_cuda_mps(monkeypatch):
    import omni_server.server
    from omni_server import cli

    seen = []

    async def serve(cfg, *args, **kwargs):  # (the config as `serve` would run it)
        seen.append(cfg.cuda_mps)
        return 0

    monkeypatch.setattr(omni_server.server, "serve", serve)
    config = str(REPO / "configs/qwen2_5_omni.yaml")  # (cuda_mps: auto)
    for flags in (["--cuda-mps", "false"], ["--cuda-mps", "true"], []):
        assert cli.main(["serve", config, *flags]) == 0
    assert seen == [False, True, "auto"]


def test_serve_runs_its_stages_under_the_daemon_and_quits_it(fake_mps, monkeypatch, tiny_models, caplog):
    """`serve` itself, as on a GPU host (the host check answers yes; the stages still run on CPU):
    the daemon starts before the stages; a stage that cannot start ends the server with a hint
    that MPS was on, then the stage's own reason last; and the daemon is quit on the way out."""
    import asyncio

    import omni_server.orchestrator.launcher as launcher
    from omni_server.config import load_config
    from omni_server.server import serve
    from tests.conftest import free_port

    monkeypatch.setattr(launcher, "_cuda_host", lambda: True)
    empty = fake_mps / "empty-model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")  # (a folder no model loads from; without a config.json the stage says so first)
    overrides = [f"token2wav.model={empty}"]
    cfg = load_config(REPO / "configs/default.yaml", overrides)
    cfg.cuda_mps, cfg.server.port, cfg.runtime_dir = True, free_port(), str(fake_mps / "run")
    with caplog.at_level(logging.INFO):
        assert asyncio.run(serve(cfg)) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "CUDA MPS daemon started" in caplog.text
    assert errors[-2].startswith("the stages ran as clients of serve's CUDA MPS daemon (cuda_mps)")
    assert errors[-1].startswith("stage 2 (token2wav) failed to start (exit code 1): ValueError: Unrecognized model")
    assert (fake_mps / "run/mps/log/stdin").read_text() == "quit\n"  # quit once, by serve on its way out
    assert (fake_mps / "run/mps/log/calls").read_text() == "-d\n\n"
