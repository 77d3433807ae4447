"""Which streams a streamed generation pass takes: furthest-behind listeners first, unpadded pass
sizes when no stream would run dry waiting."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from omni_server.stage.generation import GenerationStage
from omni_server.stage.stream_order import Playback, pick

POW2 = [1, 2, 4, 8, 16]


def test_playback_slack_is_audio_sent_minus_time_played_and_waiting_counts_before_any_audio():
    p = Playback()
    p.open("a", 0.0)
    p.open("b", 1.0)
    p.open("c", 0.0)
    p.sent("a", 1.0, now=2.0)
    p.sent("a", 0.5, now=2.2)
    p.sent("a", 0.0, now=2.3)  # (an empty piece starts nothing)
    p.sent("c", 0.2, now=0.5)
    assert p.slack("a", 2.5) == 1.5 - 0.5
    assert p.slack("c", 10.0) == 0.2 - 9.5  # ran dry 9.3 s ago
    assert p.slack("b", 5.0) == -4.0  # no audio 4 s after it opened
    assert p.slack("c", 10.0) < p.slack("b", 10.0) < p.slack("a", 10.0)

    # c's listener ran dry at 0.7 s: the next piece, at 10 s, finds it paused 9.3 s; playback resumes from there.
    assert p.sent("c", 1.0, now=10.0) == pytest.approx(9.3)
    assert p.slack("c", 10.0) == pytest.approx(1.2 - 0.2)
    assert p.sent("c", 0.5, now=10.5) == 0.0  # (1 s ahead: still playing)
    assert p.sent("b", 0.5, now=5.0) == 0.0  # (a first piece finds nothing played yet)
    p.sent("unknown", 1.0, now=1.0)  # (not a stream: nothing recorded)
    assert p.slack("unknown", 1.0) == 0.0
    p.forget("a")
    p.sent("a", 5.0, now=3.0)  # (forgotten: a late piece records nothing)
    assert p.slack("a", 3.0) == 0.0


def test_without_pass_sizes_a_pass_takes_every_ready_stream_up_to_the_limit_furthest_behind_first():
    slack = {"a": 3.0, "b": -1.0, "c": 0.5, "d": 3.0}
    assert pick(["a", "b", "c", "d"], slack, 16, None, 0.0) == ["b", "c", "a", "d"]
    assert pick(["a", "b", "c", "d"], slack, 2, None, 0.0) == ["b", "c"]


def test_a_pass_takes_the_largest_unpadded_size_and_leaves_out_the_streams_furthest_ahead():
    ready = [f"s{i}" for i in range(9)]
    slack = {rid: 5.0 + i for i, rid in enumerate(ready)}
    assert pick(ready, slack, 16, POW2, urgent_s=1.0) == ready[:8]
    assert pick(ready[:5], slack, 16, POW2, urgent_s=1.0) == ready[:4]
    assert pick(ready[:3], slack, 16, POW2, urgent_s=1.0) == ready[:3]  # one padded row of 4: a quarter at most
    assert pick(ready[:7], slack, 16, POW2, urgent_s=1.0) == ready[:7]
    twelve = [f"t{i}" for i in range(12)]
    assert len(pick(twelve, {r: 9.0 for r in twelve}, 16, POW2, urgent_s=1.0)) == 12
    assert len(pick(twelve, {r: 9.0 for r in twelve}, 8, POW2, urgent_s=1.0)) == 8  # the stage's limit


def test_streams_that_would_run_dry_waiting_are_never_left_out():
    ready = [f"s{i}" for i in range(10)]
    slack = {rid: 0.1 * i for i, rid in enumerate(ready)}  # s0..s8 below 0.85 s ahead
    assert pick(ready, slack, 16, POW2, urgent_s=0.85) == ready[:9]
    slack["new"] = -0.3  # no audio yet, waiting 0.3 s
    assert pick(ready + ["new"], slack, 16, POW2, urgent_s=0.0) == ["new"] + ready[:7]


class _FakeStreams:
    """A streaming generator stand-in: every stream is ready; each pass returns 0.5 s per stream."""

    sample_rate = 100
    stream_batch_sizes = POW2

    def __init__(self):
        self.passes: list[list[int]] = []

    def stream_ready(self, stream) -> bool:
        return True

    def stream_step(self, streams):
        self.passes.append([s.n for s in streams])
        return [torch.ones(50) for _ in streams]


def _stage(n: int) -> tuple[GenerationStage, _FakeStreams, list]:
    stage = object.__new__(GenerationStage)  # (no sockets: the pass logic alone)
    sent: list = []
    gen = _FakeStreams()
    stage.generator, stage.playback, stage._pass_s = gen, Playback(), 0.0
    stage.underruns, stage.underrun_s = 0, 0.0
    stage.stage = SimpleNamespace(max_batch_size=16, inputs=[1])
    stage.streams, stage.sources, stage.speeds = {}, {}, {}
    stage.report_use = lambda *a: None
    stage.send_outputs = sent.extend
    t = time.monotonic()
    for i in range(n):  # r0 opened first
        stage.streams[f"r{i}"] = SimpleNamespace(n=i, done=False, consumed=0, codes=None)
        stage.playback.open(f"r{i}", t + 0.001 * i)
    return stage, gen, sent


def test_the_stage_serves_unstarted_streams_first_and_keeps_passes_unpadded():
    stage, gen, sent = _stage(9)
    for i in range(1, 9):  # r1..r8 sent audio (r8 the most ahead); r0 has none yet
        stage.playback.sent(f"r{i}", 1.0 + i, now=time.monotonic())
    assert stage._step_streams() == 8
    assert gen.passes == [[0, 1, 2, 3, 4, 5, 6, 7]]  # r8 (furthest ahead) waits
    assert [d.request_id for d in sent] == [f"r{i}" for i in range(8)]
    assert all(d.tensors["audio"].numel() == 50 and not d.finished for d in sent)
    assert stage.playback.slack("r0", time.monotonic()) > 0  # r0 started: 0.5 s ahead
    stage._step_streams()
    assert gen.passes[1] == [0, 1, 2, 3, 4, 5, 6, 7]  # r0 now 1 s ahead, r8 still 9 s
    stage._pass_s = 5.0  # a recent pass so slow that every stream would run dry waiting for another
    stage._step_streams()
    assert gen.passes[2] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert stage._pass_s >= 4.5  # (the longest of late, decaying: one quick pass does not reset it)


def test_a_pass_of_new_streams_takes_the_longest_waiting_first():
    stage, gen, _ = _stage(6)  # none has audio: r0 waited longest
    stage.stage.max_batch_size = 4
    stage._step_streams()
    assert gen.passes == [[0, 1, 2, 3]]


def test_the_stage_counts_pieces_that_reach_a_listener_whose_audio_ran_out():
    stage, gen, sent = _stage(2)
    stage.playback.sent("r0", 0.5, now=time.monotonic() - 2.0)  # r0's 0.5 s ran out 1.5 s ago
    stage.playback.sent("r1", 5.0, now=time.monotonic() - 2.0)  # r1 still has 3 s to play
    stage._step_streams()
    assert stage.underruns == 1
    assert 1.5 <= stage.underrun_s < 2.0
    assert stage.playback.slack("r0", time.monotonic()) == pytest.approx(0.5, abs=0.2)  # (resumed: the new piece)


def test_a_finished_streams_last_piece_counts_too():
    stage, gen, sent = _stage(1)
    stage.playback.sent("r0", 0.5, now=time.monotonic() - 2.0)  # ran out 1.5 s ago
    stage.streams["r0"].done = True  # (this pass gives its last piece)
    stage.drop = lambda rids: [stage.streams.pop(r) and stage.playback.forget(r) for r in rids]
    stage._step_streams()
    assert sent[0].finished and stage.underruns == 1 and stage.underrun_s >= 1.5
    assert stage.streams == {}
