"""OMNI_PROFILE: a stage profiles a window of its busy steps and writes the top operators."""

from __future__ import annotations

import pytest
import torch

from omni_server.stage.profiling import StepProfiler


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
        "--stage-arg", f"token2wav.env.OMNI_PROFILE=dir={prof},batch=1,skip=0,steps=1"])
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
