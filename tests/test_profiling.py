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


def test_unset_is_off_and_a_missing_dir_is_an_error(monkeypatch):
    monkeypatch.delenv("OMNI_PROFILE", raising=False)
    assert StepProfiler.from_env("x") is None
    monkeypatch.setenv("OMNI_PROFILE", "batch=2")
    with pytest.raises(ValueError, match="dir="):
        StepProfiler.from_env("x")
