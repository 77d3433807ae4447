"""Stage start order: engines sharing a GPU start one after another, others at once."""

from __future__ import annotations

from pathlib import Path

from omni_server.config import load_config_text
from omni_server.orchestrator.launcher import Launcher

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
    launcher = Launcher(load_config_text(CONFIG), "unused.yaml", Path("/tmp"))
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


def test_cpu_host_starts_everything_at_once():
    launcher = _launcher(False)
    assert [launcher.start_after(u) for u in launcher.cfg.units()] == [[]] * 6
