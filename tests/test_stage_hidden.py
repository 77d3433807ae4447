"""Stage-side bookkeeping of hidden-state captures (no engine)."""

from __future__ import annotations

import pickle

import torch

from omni_server.stage.ar import _Tracked, _truncate
from omni_server.stage.hidden import HiddenCapture


def test_compact_joins_the_loose_rows_into_memory_of_their_own():
    step1 = HiddenCapture(["a", "b"], [2, 1], [0, 0], torch.arange(12.0).reshape(3, 4))
    step2 = HiddenCapture(["a", "b"], [1, 1], [2, 1], torch.arange(8.0).reshape(2, 4) + 100)
    own = torch.zeros(1, 4)
    t = _Tracked(prompt_token_ids=[1, 2], forward_to=[1], hidden=[own, step1.hidden[0:2], step2.hidden[0:1]],
                 hidden_len=4, loose=2)
    t.compact()
    assert len(t.hidden) == 2 and t.hidden[0] is own and t.loose == 0
    joined = t.hidden[1]
    for step in (step1, step2):
        assert joined.untyped_storage().data_ptr() != step.hidden.untyped_storage().data_ptr()
    assert torch.equal(joined, torch.cat([torch.arange(8.0).reshape(2, 4), torch.arange(4.0)[None] + 100]))
    t.compact()  # nothing loose: nothing changes
    assert t.hidden[1] is joined


def test_compact_releases_rows_every_consumer_had_in_chunks():
    """A request whose consumers all stream drops the pieces they had (a long prompt's rows: no
    copy of them, and its step buffer is not pinned on); one with a consumer that takes the rows
    whole keeps them. Chunks after that hold the right rows; so does a truncation."""
    from types import SimpleNamespace

    from omni_server.stage.ar import ARStage

    buf = torch.arange(40.0).reshape(10, 4)  # a step's capture: prompt rows 0-6, then decode rows
    whole = _Tracked(prompt_token_ids=[0] * 6, forward_to=[1, 2], stream_to=[1], hidden=[buf[:7]],
                     hidden_len=7, loose=1, sent_rows=7)
    whole.compact()
    assert whole.dropped == 0 and torch.equal(torch.cat(whole.hidden), buf[:7])
    t = _Tracked(prompt_token_ids=[0] * 6, forward_to=[1], stream_to=[1], hidden=[buf[:7], buf[7:8]],
                 hidden_len=8, loose=2, sent_rows=7)
    t.compact()
    assert t.dropped == 7 and len(t.hidden) == 1 and t.loose == 0 and torch.equal(t.hidden[0], buf[7:8])
    t.sent_rows = 8
    t.compact()  # all sent: a row-less piece of the rows' shape and dtype, in memory of its own
    assert t.dropped == 8 and t.hidden[0].shape == (0, 4) and t.hidden[0].dtype == buf.dtype
    assert t.hidden[0].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    sent = []
    stage = SimpleNamespace(stage_id=0, send_stage=lambda dst, rid, msg: sent.append(msg))
    t.output_token_ids = [1, 2, 3]
    t.hidden.append(buf[8:10])
    t.hidden_len, t.loose = 10, 1
    ARStage._send_chunk(stage, "r", t, final=True, end=9)
    assert torch.equal(sent[-1].tensors["hidden"], buf[8:9]) and t.sent_rows == 9
    _truncate(t, 9)  # (recomputed from a position held)
    assert t.hidden_len == 9 and torch.equal(torch.cat(t.hidden), buf[8:9])
    _truncate(t, 5)  # (from before the rows held: the consumer had rows 5-8 already)
    assert t.hidden_len == t.dropped == 5 and t.hidden == [] and t.loose == 0


def test_truncate_after_preemption_keeps_the_prefix():
    t = _Tracked(prompt_token_ids=[], forward_to=[1], hidden=[torch.zeros(4, 2), torch.ones(3, 2)], hidden_len=7)
    _truncate(t, 5)
    assert t.hidden_len == 5 and torch.cat(t.hidden).shape == (5, 2) and torch.cat(t.hidden)[4, 0] == 1


def test_truncate_counts_the_loose_pieces_it_keeps():
    pieces = [torch.zeros(4, 2), torch.ones(3, 2), torch.full((2, 2), 2.0)]  # the last two loose
    t = _Tracked(prompt_token_ids=[], forward_to=[1], hidden=list(pieces), hidden_len=9, loose=2)
    _truncate(t, 5)
    assert t.hidden_len == 5 and len(t.hidden) == 2 and t.loose == 1
    _truncate(t, 3)
    assert t.hidden_len == 3 and len(t.hidden) == 1 and t.loose == 0


def test_capture_crosses_processes_without_its_event():
    class Event:
        waited = False

        def synchronize(self):
            Event.waited = True

    cap = HiddenCapture(["a"], [1], [0], torch.ones(1, 2), Event())
    clone = pickle.loads(pickle.dumps(cap))  # vLLM's multiproc executor pickles worker outputs
    assert Event.waited and clone.event is None and torch.equal(clone.hidden, cap.hidden)
