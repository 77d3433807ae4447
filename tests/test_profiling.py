"""OMNI_PROFILE: a stage profiles a window of its busy steps and writes the top operators;
OMNI_STEP_LOG: a stage logs every step's batch and time."""

from __future__ import annotations

import pytest
import torch

from omni_server.stage.profiling import StepLog, StepProfiler


def test_profiles_only_busy_steps_after_the_warm_up(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PROFILE", f"dir={tmp_path / 'prof'},batch=2,skip=1,steps=2")
    prof = StepProfiler.from_env("stage1-talker-r0")
    a = torch.randn(64, 64)
    ops = {2: lambda: a.cos(), 3: lambda: a.sum(), 4: lambda: a @ a, 5: lambda: a.exp()}
    # running per step: 1 (too few), 3 (the warm-up step), 1 (too few, before the window), 4 and 2
    # (the profiled window), 5 (after it)
    for step, running in enumerate([1, 3, 1, 4, 2, 5]):
        prof.before(running)
        ops.get(step, lambda: a.abs())()
        prof.after()
    prof.finish()  # a no-op once written
    text = (tmp_path / "prof" / "stage1-talker-r0.txt").read_text()
    assert text.startswith("2 steps with >= 2 requests running")
    assert "aten::mm" in text and "aten::sum" in text
    assert "aten::cos" not in text and "aten::exp" not in text


def test_steps_that_computed_nothing_do_not_count(tmp_path):
    # A streaming stage's requests all waiting for input: the loop steps, the engine computes nothing.
    prof = StepProfiler(tmp_path / "p.txt", batch=1, skip=1, steps=2)
    a = torch.randn(64, 64)
    for op, served in [(a.abs, False), (a.sum, True), (a.cos, False), (a.exp, False), (lambda: a @ a, True),
                       (a.cos, False), (a.tanh, True), (a.sin, True)]:
        prof.before(1)
        op()
        prof.after(served)
    text = (tmp_path / "p.txt").read_text()
    assert text.startswith("2 steps with >= 1 requests running")  # the served mm and tanh steps
    assert "aten::mm" in text and "aten::tanh" in text
    assert "aten::sum" not in text and "aten::sin" not in text  # the warm-up step; after the window


def test_unset_is_off_and_a_missing_dir_is_an_error(monkeypatch):
    monkeypatch.delenv("OMNI_PROFILE", raising=False)
    assert StepProfiler.from_env("x") is None
    monkeypatch.setenv("OMNI_PROFILE", "batch=2")
    with pytest.raises(ValueError, match="dir="):
        StepProfiler.from_env("x")


def test_stages_write_profiles_and_full_mode_batches_count(tiny_models, tmp_path):
    # A real server: OMNI_PROFILE in two stages' env (through --stage-arg), token2wav decoding whole
    # replies (input_mode full): its stats count the requests each step decoded.
    import concurrent.futures
    import time

    import httpx
    import openai

    from tests.conftest import REPO, STARTUP_TIMEOUT, Server

    prof = tmp_path / "prof"
    server = Server(REPO / "configs" / "default.yaml", tmp_path / "serve.log", args=[
        "--stage-arg", "token2wav.input_mode=full",
        "--stage-arg", f"thinker.env.OMNI_PROFILE=dir={prof},batch=1,skip=2,steps=3",
        "--stage-arg", f"token2wav.env.OMNI_PROFILE=dir={prof},batch=1,skip=0,steps=1",
        "--stage-arg", f"token2wav.env.OMNI_STEP_LOG={tmp_path / 'steps'}"])
    try:
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")

        def chat(i):
            return client.chat.completions.create(
                model="omni-tiny", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=8,
                modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"}).choices[0].message.audio
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert all(a.data for a in pool.map(chat, range(2)))
        stats = httpx.get(f"{server.base_url}/v1/omni/stages/2/stats", timeout=30).json()
        assert stats["steps"] >= 1 and stats["batch_sum"] == 2  # each reply decoded once, in some step
    finally:
        assert server.stop() == 0
    thinker = (prof / "stage0-thinker-r0.txt").read_text()
    token2wav = (prof / "stage2-token2wav-r0.txt").read_text()
    assert thinker.startswith("3 steps with >= 1 requests running") and "aten::" in thinker
    assert token2wav.startswith("1 steps with >= 1 requests running") and "aten::" in token2wav
    # OMNI_STEP_LOG: every token2wav step, the last ones written when the stage stopped; the two
    # replies' decodes in the steps its stats counted.
    lines = (tmp_path / "steps" / "stage2-token2wav-r0.steps").read_text().splitlines()
    steps = [line.split() for line in lines if not line.startswith("#")]
    assert sum(int(s[2]) > 0 for s in steps) == stats["steps"] and sum(int(s[2]) for s in steps) == 2


def test_step_log_lines_and_unset(tmp_path, monkeypatch):
    import os
    import time

    monkeypatch.delenv("OMNI_STEP_LOG", raising=False)
    assert StepLog.from_env("x") is None
    monkeypatch.setenv("OMNI_STEP_LOG", str(tmp_path / "steps"))
    out = tmp_path / "steps" / "stage2-token2wav-r0.steps"
    t0 = time.time()
    for process in range(2):  # a restarted stage appends after the lines of the one before
        log = StepLog.from_env("stage2-token2wav-r0")
        log.flush_every = 2  # (written after every 2 steps)
        assert out.read_text().splitlines()[-1] == f"# pid {os.getpid()}"  # written at once
        for running, served in [(3, 3), (4, 0), (5, 2)]:
            log.before(running)
            t = time.perf_counter()
            torch.randn(256, 256).sum()
            log.after(served, time.perf_counter() - t)
        assert len(out.read_text().splitlines()) == process * 4 + 3
        log.finish()
    lines = out.read_text().splitlines()
    assert lines[0] == lines[4] == f"# pid {os.getpid()}"
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert [(int(r[1]), int(r[2])) for r in rows] == [(3, 3), (4, 0), (5, 2)] * 2
    starts, ms = [float(r[0]) for r in rows], [float(r[3]) for r in rows]
    assert t0 - 1 < starts[0] and starts == sorted(starts) and starts[-1] < time.time() + 1  # Unix time
    assert all(m > 0 for m in ms)


def test_step_log_time_flush_and_a_failed_write(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OMNI_STEP_LOG", str(tmp_path))
    log = StepLog.from_env("s")
    log.flush_s = 0.0  # every step's line goes out after it (an idle stage's last lines are not held)
    log.before(1)
    log.after(1, 0.005)
    assert len((tmp_path / "s.steps").read_text().splitlines()) == 2
    (tmp_path / "s.steps").unlink()
    (tmp_path / "s.steps").mkdir()  # the file cannot be opened now: the log turns off, the stage serves on
    log.before(1)
    log.after(1, 0.005)
    assert log.off and "step log off" in caplog.text
    log.before(1)
    log.after(1, 0.005)
    assert log.rows == []
    log.finish()


def test_an_unwritable_step_log_fails_at_start(tmp_path, monkeypatch):
    (tmp_path / "s.steps").mkdir()
    monkeypatch.setenv("OMNI_STEP_LOG", str(tmp_path))
    with pytest.raises(OSError):
        StepLog.from_env("s")


def test_step_log_summary_groups_steps_by_batch(tmp_path):
    from benchmarks.step_log import summarise

    f = tmp_path / "stage2-token2wav-r0.steps"
    # (start, running, served, ms): a header, a flush-only step (served 0), batches 1, 1, 3 and 10, 12
    # (one range), a line cut short
    f.write_text("# pid 7\n0 1 0 1.0\n0.1 1 1 60\n0.2 1 1 80\n0.3 3 3 90\n0.4 10 10 200\n0.6 12 12 300\n0.9 2 2\n")
    s = summarise(f)
    assert s["steps"] == 5 and s["step_s"] == 0.73
    rows = {r["served"]: r for r in s["by_served"]}
    assert list(rows) == ["1", "3", "9-16"]
    assert rows["1"]["steps"] == 2 and rows["1"]["ms_p50"] == 70 and rows["1"]["ms_p90"] == 80
    assert rows["3"]["ms_per_request_p50"] == 30
    assert rows["9-16"]["mean_served"] == 11 and rows["9-16"]["ms_per_request_p50"] == 22.5
