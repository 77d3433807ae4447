"""Stage-side bookkeeping of hidden-state captures (no engine)."""

from __future__ import annotations

import pickle

import torch

from omni_server.stage.ar import _Tracked, _truncate
from omni_server.stage.hidden import HiddenCapture


def test_settle_detaches_rows_from_a_shared_step_buffer():
    step = HiddenCapture(["a", "b"], [2, 1], [0, 0], torch.arange(12.0).reshape(3, 4))
    t = _Tracked(prompt_token_ids=[1, 2], forward_to=[1])
    t.hidden.append(step.hidden[0:2])
    t.pending.append((step, 0, True))
    assert t.hidden[0].untyped_storage().data_ptr() == step.hidden.untyped_storage().data_ptr()
    t.settle()
    assert t.hidden[0].untyped_storage().data_ptr() != step.hidden.untyped_storage().data_ptr()
    assert torch.equal(t.hidden[0], torch.arange(8.0).reshape(2, 4)) and t.pending == []


def test_settle_keeps_an_exclusive_buffer_without_copying():
    step = HiddenCapture(["a"], [3], [0], torch.ones(3, 4))
    t = _Tracked(prompt_token_ids=[1], forward_to=[1], hidden=[step.hidden[0:3]], pending=[(step, 0, False)])
    t.settle()
    assert t.hidden[0].data_ptr() == step.hidden.data_ptr()


def test_truncate_after_preemption_keeps_the_prefix():
    t = _Tracked(prompt_token_ids=[], forward_to=[1], hidden=[torch.zeros(4, 2), torch.ones(3, 2)], hidden_len=7)
    _truncate(t, 5)
    assert t.hidden_len == 5 and torch.cat(t.hidden).shape == (5, 2) and torch.cat(t.hidden)[4, 0] == 1


def test_capture_crosses_processes_without_its_event():
    class Event:
        waited = False

        def synchronize(self):
            Event.waited = True

    cap = HiddenCapture(["a"], [1], [0], torch.ones(1, 2), Event())
    clone = pickle.loads(pickle.dumps(cap))  # vLLM's multiproc executor pickles worker outputs
    assert Event.waited and clone.event is None and torch.equal(clone.hidden, cap.hidden)
