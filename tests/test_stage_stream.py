"""An AR stage streaming its output to a consumer (`input_mode: stream`), in-process through
tests/stage_probe.py on the default pipeline's tiny thinker: when chunks leave and what they hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "default.yaml"


def _probe(*args, **kwargs) -> list[dict]:
    """One probe run to its end: what its stage sent (`_start`'s arguments)."""
    return _read(_start(*args, **kwargs))


def _start(tmp_path: Path, prompt: list[int], max_tokens: int, *extra: str,
           processor: str = "hidden_to_embeds", config: Path = CONFIG, stage: int = 0):
    """A probe started (`_read` waits for it): a test's probes run side by side, each building its
    own engine, most of a probe's time."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.stage_probe", str(config), str(stage), str(tmp_path), "--processor", processor,
         "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(max_tokens), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, tmp_path


def _read(started) -> list[dict]:
    proc, tmp_path = started
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    sent = []
    for n in range(len(list(tmp_path.glob("probe.*.safetensors")))):
        with safe_open(str(tmp_path / f"probe.{n}.safetensors"), "pt") as f:
            meta = f.metadata()
            hidden = f.get_tensor("hidden") if "hidden" in f.keys() else torch.zeros(0)
            sent.append({"hidden": hidden, "step": int(meta["step"]), "final": meta["final"] == "True",
                         "out": [int(t) for t in meta["output_token_ids"].split(",") if t]})
    return sent


def test_first_chunk_leaves_in_the_step_that_computed_its_row(tmp_path):
    """Step 0 prefills the prompt (and samples reply token 0): the prompt's rows leave in step 0,
    alone (the step's piece as it is, not joined to a later row). Step 1 computes reply position
    0's row and samples token 1, which lets the consumer start: that row leaves in step 1 (not a
    step later, nor once a whole chunk of reply rows is in). Then, with 8 requests running, every
    4 positions (the consumer's chunk), each in the step that computed it, then the rest;
    together the rows a full-mode consumer gets. Alone, the request sends every row in the step
    that computed it (few requests: about two chunk messages per step, `ARStage.rows_chunk`)."""
    prompt, n_out = [11, 12, 13, 14, 15, 16, 17], 14
    runs = (_start(tmp_path / "stream", prompt, n_out, "--stream", "4", "--requests", "8"),
            _start(tmp_path / "alone", prompt, n_out, "--stream", "4"), _start(tmp_path / "full", prompt, n_out))
    streamed, alone, (whole,) = map(_read, runs)
    for sent in (streamed, alone):
        first, second = sent[:2]
        assert first["step"] == 0 and len(first["hidden"]) == len(prompt) and not first["final"]
        assert first["out"] == whole["out"][:1]
        # With the token sampled in step 1 too: the consumer knows reply token 0 is not the last.
        assert second["step"] == 1 and len(second["hidden"]) == 1 and second["out"] == whole["out"][1:2]
        # Every chunk leaves in the step that computed its last row (reply position j's row: step j + 1).
        ends = torch.tensor([len(c["hidden"]) for c in sent]).cumsum(0).tolist()
        assert [c["step"] for c in sent] == [0] + [end - len(prompt) for end in ends[1:]]
        rows = torch.cat([c["hidden"] for c in sent])
        assert rows.shape == whole["hidden"].shape == (len(prompt) + n_out - 1, rows.shape[1])
        if sent is alone:
            assert torch.equal(rows, whole["hidden"])
        else:  # (a batch of 8 rounds its matmuls differently)
            torch.testing.assert_close(rows, whole["hidden"], rtol=1e-4, atol=1e-5)
        assert sum((c["out"] for c in sent), []) == whole["out"]
        assert sent[-1]["final"]
    assert [len(c["hidden"]) for c in streamed[2:]] == [4, 4, 4]
    assert {len(c["hidden"]) for c in alone[2:-1]} == {1} and len(alone[-1]["hidden"]) <= 1


def test_token_chunks_leave_in_the_step_that_sampled_them(tmp_path):
    """A consumer of tokens only (as token2wav reads the talker's codes): the first token at once,
    then at every multiple of 4 (token2wav's windows end on multiples of the chunk), each chunk in
    the step that sampled its last token (token j: step j)."""
    prompt, n_out = [11, 12, 13, 14, 15, 16, 17], 14
    sent = _probe(tmp_path, prompt, n_out, "--stream", "4", processor="qwen2_5_omni.talker_to_token2wav")
    assert [len(c["out"]) for c in sent] == [1, 3, 4, 4, 2] and sent[-1]["final"]
    assert all(len(c["hidden"]) == 0 for c in sent)  # nobody reads hidden states: none captured
    ends = torch.tensor([len(c["out"]) for c in sent]).cumsum(0).tolist()
    assert [c["step"] for c in sent[:-1]] == [end - 1 for end in ends[:-1]]
    assert ends[-1] == n_out


def _consumer(processor, rows_given: int, ids=("r",)):
    """A stage with only base.Stage's input handling (`_start_dirty`, as its loop runs it after
    each drain): what it hands its processor, start, extend."""
    from types import SimpleNamespace

    from omni_server.stage.base import Stage, _Waiting
    from omni_server.wire.messages import ExpectRequest, SamplingSpec, StagePayload

    calls, waiting = [], {}
    for rid in ids:
        w = waiting[rid] = _Waiting(expect=ExpectRequest(request_id=rid, sources=[0], sampling=SamplingSpec()))
        w.merge(StagePayload(request_id=rid, source_stage=0, prompt_token_ids=[1, 2], output_token_ids=[3],
                             tensors={}, final=False))
    fake = Stage.__new__(Stage)  # (no engine, no sockets)
    fake.__dict__.update(waiting=waiting, _dirty={}, stage=SimpleNamespace(input_mode="stream", name="s"),
                         stage_id=1, processor=processor, step_rows_given=lambda rid: rows_given,
                         starved=set(), credited={},
                         start=lambda expect, si, final: calls.append(("start", si)),
                         extend=lambda rid, si, final: calls.append(("extend", si)),
                         fail=lambda *a, **k: calls.append(("fail", a)))
    return fake, calls


def _new_input(fake) -> None:
    fake._dirty["r"] = None
    fake._start_dirty()


def test_incremental_processors_are_told_the_rows_the_stage_holds():
    from omni_server.stage.processors import StageInput

    seen = []

    def proc(payloads, ctx, options, **kw):
        seen.append(kw)
        return StageInput()

    for incremental in (True, False):
        seen.clear()
        proc.incremental = incremental
        fake, calls = _consumer(proc, rows_given=5)
        _new_input(fake)  # starts the request: the whole input so far
        _new_input(fake)  # a later chunk
        assert [c[0] for c in calls] == ["start", "extend"]
        assert seen == ([{}, {"since": 5}] if incremental else [{}, {}])


def test_inputs_built_in_one_loop_are_waited_for_after_all_are_built():
    """Every request with new input gets its processor call first, then the stage waits for their
    device -> host copies (StageInput.host_ready) and hands them on: the copies overlap, and the
    first wait covers the others (one side stream), instead of a wait between processor calls."""
    from omni_server.stage.processors import StageInput

    order = []

    class Copied:  # stands in for the CUDA event of a processor's host copies
        def __init__(self, rid):
            self.rid = rid

        def synchronize(self):
            order.append(("wait", self.rid))

    def proc(payloads, ctx, options, **kw):
        rid = next(iter(payloads.values())).request_id
        order.append(("build", rid))
        return StageInput(host_ready=Copied(rid))

    fake, calls = _consumer(proc, rows_given=0, ids=("a", "b"))
    fake._dirty.update(a=None, b=None)
    fake._start_dirty()
    assert order == [("build", "a"), ("build", "b"), ("wait", "a"), ("wait", "b")]
    assert [c[0] for c in calls] == ["start", "start"] and all(c[1].host_ready is None for c in calls)


def test_frame_chunks_end_on_multiples_of_the_chunk():
    """A model that completes each token into a frame one step later (Qwen3's talker): the first
    token at once, then whenever the frames cross a multiple of the chunk (code2wav's windows are
    frames), checked on the producer's bookkeeping step by step."""
    from omni_server.stage.ar import _Tracked

    for chunk in (1, 5):
        t = _Tracked(prompt_token_ids=[1], forward_to=[2], stream_to=[2], chunk=chunk, with_hidden=False)
        sent_at = []
        for step in range(12):
            t.output_token_ids.append(100 + step)  # token `step`, sampled in this step...
            if step:
                t.frames.append(torch.zeros(16))  # ...and the frame of the token before it
            if t.chunk_ready():
                sent_at.append((len(t.output_token_ids), len(t.frames)))
                t.mark_sent(len(t.output_token_ids))
        frames_sent = [f for _, f in sent_at]
        assert sent_at[0] == (1, 0)
        assert frames_sent[1:] == list(range(chunk, 12, chunk))


def test_merged_stream_chunks_equal_their_concatenation_and_grow_in_place():
    """A streamed input's chunks merge into views of one growing buffer per tensor: the same rows
    as concatenating them, earlier views unchanged by later chunks, and a long stream reallocates
    a few times (doubling), not once per chunk."""
    from omni_server.stage.base import _Waiting
    from omni_server.wire.messages import StagePayload

    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, 6, generator=g) for n in [40] + [8] * 60]
    codes = [torch.arange(k, k + 2)[:, None].repeat(1, 3) for k in range(0, 122, 2)]
    w, seen, buffers = _Waiting(), [], set()
    for k, (rows, c) in enumerate(zip(chunks, codes)):
        w.merge(StagePayload(request_id="r", source_stage=3, prompt_token_ids=[1, 2] if k == 0 else [],
                             output_token_ids=[k], tensors={"hidden": rows, "codes": c}, final=k == 60))
        merged = w.payloads[3]
        seen.append(merged.tensors["hidden"])
        buffers.add(merged.tensors["hidden"].untyped_storage().data_ptr())
    assert merged.final and merged.prompt_token_ids == [1, 2] and merged.output_token_ids == list(range(61))
    assert torch.equal(merged.tensors["hidden"], torch.cat(chunks))
    assert torch.equal(merged.tensors["codes"], torch.cat(codes))
    for k, view in enumerate(seen):
        assert torch.equal(view, torch.cat(chunks[:k + 1]))
    assert len(buffers) <= 5  # 520 rows: the first chunk's own memory, then buffers of 96, 192, 384, 768


def test_a_chunk_that_does_not_fit_fails_its_request_not_the_stage():
    """A streamed chunk whose tensor rows do not match the earlier ones (another width): that
    request fails with an error to the api; the stage keeps serving and drops its later chunks."""
    from omni_server.config import load_config_text
    from omni_server.stage.base import Stage
    from omni_server.wire.messages import StagePayload

    cfg = load_config_text("""
model: m
stages:
  - {id: 0, name: a, model: x, output: text}
  - {id: 1, name: b, model: x, inputs: [0], input_processor: hidden_to_embeds, input_mode: stream}
""")
    sent = []
    sockets = SimpleNamespace(replica=0, send_api=sent.append, send_stage=lambda *a, **k: None)
    stage = Stage(cfg, 1, sockets)

    def chunk(rid, width, final=False):
        return StagePayload(request_id=rid, source_stage=0, prompt_token_ids=[], output_token_ids=[1],
                            tensors={"hidden": torch.zeros(2, width)}, final=final)

    stage._handle(chunk("bad", 4))
    stage._handle(chunk("good", 4))
    stage._handle(chunk("bad", 5))  # does not raise
    (out,) = sent
    (delta,) = out.deltas
    assert delta.request_id == "bad" and delta.finish_reason == "error" and "bad input from stage 0" in delta.error
    assert "bad" not in stage.waiting and "good" in stage.waiting
    stage._handle(chunk("bad", 4, final=True))  # later chunks of the failed request are dropped
    assert "bad" not in stage.waiting
    stage._handle(chunk("good", 4, final=True))
    assert stage.waiting["good"].payloads[0].tensors["hidden"].shape == (4, 4)


def test_steps_that_advance_nothing_add_time_but_no_step():
    """The stage loop's counters: an engine step that advanced no request (it only told the engine
    of finished ones) adds its seconds to step_s but is neither a step nor part of the batch sum."""
    from omni_server.config import load_config_text
    from omni_server.stage.base import Stage

    cfg = load_config_text("model: m\nstages:\n  - {id: 0, name: a, model: x, output: text}\n")
    sockets = SimpleNamespace(replica=0, send_api=lambda msg: None, recv_inputs=lambda timeout_ms: iter(()))

    class Counted(Stage):
        served = [0, 3, 0, 2]

        def has_work(self):
            return bool(self.served)

        def step(self):
            served = self.served.pop(0)
            self.running = bool(self.served)
            return served

    stage = Counted(cfg, 0, sockets)
    stage.run()
    assert (stage.steps, stage.batch_sum) == (2, 5) and stage.step_s > 0


def test_a_loop_slow_between_steps_says_where_the_time_went(caplog):
    """Time spent outside engine steps (draining messages, building inputs) holds every request's
    output back; past `slow_loop_s` the loop logs how long and in which part."""
    import logging
    import time

    from omni_server.config import load_config_text
    from omni_server.stage.base import Stage

    cfg = load_config_text("model: m\nstages:\n  - {id: 0, name: a, model: x, output: text}\n")
    sockets = SimpleNamespace(replica=0, send_api=lambda msg: None, recv_inputs=lambda timeout_ms: iter(()))

    class SlowInputs(Stage):
        slow_loop_s = 0.05
        loops = [0.0, 0.2]  # seconds each loop's input building takes

        def _start_dirty(self):
            time.sleep(self.loops.pop(0))
            self.running = bool(self.loops)

        def has_work(self):
            return False

    with caplog.at_level(logging.WARNING, logger="omni_server.stage.base"):
        SlowInputs(cfg, 0, sockets).run()
    (record,) = [r for r in caplog.records if "between engine steps" in r.getMessage()]
    assert "stage 0 (a)" in record.getMessage() and "0 messages" in record.getMessage()
    assert "inputs built in 0.2" in record.getMessage()


def test_a_consumer_waiting_for_input_is_never_too_far_behind():
    """Backpressure's bookkeeping on the producer (`ar._Tracked`): the request pauses once it is
    `window` tokens ahead of a live consumer's reported use, except while that consumer said it
    waits for input (it cannot use tokens it has not been sent, nor the last ones of a chunk it
    reads a step behind); the next chunk sent ends that, and a finished consumer never holds it."""
    from omni_server.stage.ar import _Tracked

    t = _Tracked(prompt_token_ids=[1, 2], forward_to=[1], stream_to=[1], window=1, with_hidden=False)
    t.output_token_ids = [5, 6]
    t.mark_sent(2)  # 2 tokens out, none reported used
    assert t.too_far_ahead()
    t.acked[1] = 1
    assert t.too_far_ahead()  # 1 ahead of the window of 1
    t.starved.add(1)  # the consumer used all it could and waits (StreamCredit.waiting)
    assert not t.too_far_ahead()
    t.output_token_ids.append(7)
    t.mark_sent(3)  # the next chunk went out: the consumer has input again
    assert t.too_far_ahead()
    t.done_to.add(1)  # it finished first (consumed -1)
    assert not t.too_far_ahead()


def test_chunks_send_views_of_one_piece_and_cut_the_final_rows():
    """A chunk within one held piece (a long prompt's rows: one step's) goes out as a view of it,
    not a copy; the final chunk of a streamed-only request sends the rows not sent yet, up to its
    last fed position, without joining all of them; rows past that position never go out."""
    from omni_server.stage.ar import ARStage, _Tracked

    sent = []
    stage = SimpleNamespace(stage_id=0, send_stage=lambda dst, rid, msg: sent.append(msg))
    rows = torch.arange(40.0).reshape(10, 4)
    tracked = _Tracked(list(range(7)), [1], [1], 4)
    tracked.output_token_ids = [1]
    tracked.hidden, tracked.hidden_len = [rows[:8]], 8  # prompt + reply position 0, one step's
    ARStage._send_chunk(stage, "r", tracked, final=False)
    assert sent[-1].tensors["hidden"].data_ptr() == rows.data_ptr() and tracked.sent_rows == 8
    assert torch.equal(sent[-1].tensors["hidden"], rows[:8]) and sent[-1].prompt_token_ids == list(range(7))
    tracked.hidden += [rows[8:9], rows[9:10]]  # the last step ran one position past the end
    tracked.hidden_len, tracked.output_token_ids = 10, [1, 2, 3]
    ARStage._send_chunk(stage, "r", tracked, final=True, end=9)
    assert torch.equal(sent[-1].tensors["hidden"], rows[8:9]) and sent[-1].final and tracked.sent_rows == 9
    ARStage._send_chunk(stage, "r", tracked, final=True, end=7)  # (all sent already: nothing more)
    assert sent[-1].tensors["hidden"].shape == (0, 4)  # (the talker appends it to its rows)
    tracked.sent_rows = 4  # several pieces: joined, then cut at `end`
    ARStage._send_chunk(stage, "r", tracked, final=True, end=9)
    assert torch.equal(sent[-1].tensors["hidden"], rows[4:9])


def test_a_prompt_of_embeddings_alone_sends_a_row_for_every_position(tmp_path):
    """A stage fed embeddings without ids (`hidden_to_embeds`) that feeds a hidden-state reader:
    its prompt's rows count as the prompt (they were counted from the ids: none), whole and streamed."""
    config, n_prompt, n_out = REPO / "tests" / "configs" / "two_stage.yaml", 10, 5
    runs = (_start(tmp_path / "full", [1], n_out, "--prompt-embeds", str(n_prompt), config=config, stage=1),
            _start(tmp_path / "stream", [1], n_out, "--prompt-embeds", str(n_prompt), "--stream", "2",
                   config=config, stage=1))
    (whole,), streamed = map(_read, runs)
    assert len(whole["out"]) == n_out and len(whole["hidden"]) == n_prompt + n_out - 1
    assert len(streamed[0]["hidden"]) == n_prompt and streamed[-1]["final"]
    assert torch.equal(torch.cat([c["hidden"] for c in streamed]), whole["hidden"])


def test_steps_that_keep_advancing_nothing_wait_on_the_socket():
    """A stage with work that cannot advance (every running request held for input or credit, the
    rest waiting for a slot) waits on its socket between steps from the second empty step on, not
    spinning a core; a step that advances something makes it poll without waiting again."""
    from omni_server.config import load_config_text
    from omni_server.stage.base import IDLE_POLL_MS, Stage

    cfg = load_config_text("model: m\nstages:\n  - {id: 0, name: a, model: x, output: text}\n")
    waits = []
    sockets = SimpleNamespace(replica=0, send_api=lambda msg: None,
                              recv_inputs=lambda timeout_ms: waits.append(timeout_ms) or iter(()))

    class Stuck(Stage):
        served = [0, 0, 0, 0, 1, 0, 0]

        def has_work(self):
            return True

        def step(self):
            served = self.served.pop(0)
            self.running = bool(self.served)
            return served

    Stuck(cfg, 0, sockets).run()
    assert waits == [0, 0, IDLE_POLL_MS, IDLE_POLL_MS, IDLE_POLL_MS, 0, 0]


def test_consumers_that_finish_before_their_input_remember_a_bounded_number_of_ids(monkeypatch):
    """A talker that ends (max tokens, its end code) while the thinker still streams to it keeps the
    request's id, so late chunks are dropped; like aborted ids, only the newest MAX_TOMBSTONES."""
    from collections import OrderedDict

    from omni_server.stage import base
    from omni_server.stage.ar import ARStage
    from omni_server.stage.base import Stage

    monkeypatch.setattr(base, "MAX_TOMBSTONES", 8)
    s = SimpleNamespace(in_engine=set(), stream_in={}, stream_src={}, waiting={}, aborted=OrderedDict(),
                        tracked={}, credits=[])
    s.forget_use = lambda rid: None
    s._end_stream = lambda rid: ARStage._end_stream(s, rid)
    s.tombstone = lambda rid: Stage.tombstone(s, rid)
    s.send_credit = lambda rid, sources, consumed: s.credits.append((rid, consumed))
    for i in range(20):
        rid = f"r{i}"
        s.in_engine.add(rid)
        s.stream_in[rid], s.stream_src[rid] = 3, [0]
        ARStage._finished(s, rid)
    assert list(s.aborted) == [f"r{i}" for i in range(12, 20)]
    assert s.credits == [(f"r{i}", -1) for i in range(20)] and not s.stream_in and not s.in_engine


def test_payloads_without_a_request_are_bounded_in_count_bytes_and_time(monkeypatch):
    """Kept for their ExpectRequest (normally ms behind, if at all): the oldest go once there are too
    many or they hold too many bytes, and any older than ORPHAN_TTL_S at the next stats query (the
    api's probe), each failed and its later chunks dropped. (The requests a restarted consumer's old
    process held had theirs kept for good: GBs of hidden rows.)"""
    import torch

    from omni_server.config import load_config_text
    from omni_server.stage import base
    from omni_server.stage.base import Stage
    from omni_server.wire.messages import StagePayload, StatsQuery

    cfg = load_config_text("model: m\nstages:\n  - {id: 0, name: a, model: x, output: text}\n"
                           "  - {id: 1, name: b, model: x, inputs: [0], input_processor: hidden_to_embeds, "
                           "output: tokens}\n")
    failed = []
    sockets = SimpleNamespace(replica=0, recv_inputs=lambda timeout_ms: iter(()),
                              send_api=lambda msg: failed.extend(d.request_id for d in getattr(msg, "deltas", ())))

    class Consumer(Stage):
        def drop(self, request_ids):
            pass

    stage = Consumer(cfg, 1, sockets)

    def payload(rid: str) -> StagePayload:
        return StagePayload(request_id=rid, source_stage=0, prompt_token_ids=[1], output_token_ids=[],
                            tensors={"hidden": torch.zeros(1, 256)})  # 1 KiB

    monkeypatch.setattr(base, "MAX_ORPHAN_PAYLOADS", 3)
    for i in range(5):
        stage._handle(payload(f"r{i}"))
    assert failed == ["r0", "r1"] and list(stage.waiting) == ["r2", "r3", "r4"]
    stage._handle(payload("r1"))  # (a late chunk of a dropped one)
    assert list(stage.waiting) == ["r2", "r3", "r4"]

    stage._handle(StatsQuery(nonce=1))  # (3 of at most 3, young, 3 KiB: all kept)
    assert len(failed) == 2
    monkeypatch.setattr(base, "MAX_ORPHAN_BYTES", 1536)
    stage._handle(StatsQuery(nonce=2))
    assert failed[2:] == ["r2", "r3"] and list(stage.waiting) == ["r4"]
    monkeypatch.setattr(base, "ORPHAN_TTL_S", 0.0)
    stage._handle(StatsQuery(nonce=3))
    assert failed[4:] == ["r4"] and not stage.waiting


def test_a_streaming_stage_admits_only_what_its_kv_cache_holds_to_the_end(tmp_path):
    """8 requests of 7 prompt + 130 reply tokens (2 blocks of 128 each, with a step's placeholder)
    and a KV cache of 5 blocks (4 usable). Feeding a full-mode consumer, vLLM admits 4 and preempts
    as they grow; feeding a streaming one, the stage admits 2 at a time and preempts none (a held
    request cannot be preempted: with preemption, producer and consumer could wait on each other).
    The replies are the same."""
    import json

    prompt, n = [11, 12, 13, 14, 15, 16, 17], 130
    args = (prompt, n, "--requests", "8", "--kv-blocks", "5")
    config = REPO / "tests" / "configs" / "two_stage.yaml"  # (its thinker's consumer reads it whole)
    runs = (_start(tmp_path / "full", *args, config=config), _start(tmp_path / "stream", *args, "--stream", "64", config=config))
    full, streamed = map(_read, runs)
    plain, reserved = (json.loads((tmp_path / d / "sched.json").read_text()) for d in ("full", "stream"))
    assert plain["preempted"] and plain["most_running"] > 2  # (the scenario: vLLM alone preempts here)
    assert reserved == {"most_running": 2, "preempted": []}
    assert sum((c["out"] for c in streamed), []) == full[0]["out"] and len(full[0]["out"]) == n


def test_a_consumer_that_cannot_start_yet_tells_its_sources_it_waits():
    """A streamed input too short for the processor to start the request (the talker needs the
    thinker's first reply row): the consumer sends a `waiting` credit for each such chunk, so a
    producer `stream_window` ahead (1 here would otherwise hold it before that row, for good) goes
    on; once started, credits come from the request's own use."""
    from types import SimpleNamespace

    from omni_server.stage.processors import StageInput

    ready = []
    fake, calls = _consumer(lambda payloads, ctx, options, **kw: StageInput() if ready else None, rows_given=0)
    credits = []
    fake.__dict__.update(stage=SimpleNamespace(input_mode="stream", name="s", stream_chunk=8),
                         send_credit=lambda rid, sources, consumed, waiting=False: credits.append(
                             (rid, sources, consumed, waiting)))
    _new_input(fake)
    _new_input(fake)  # another chunk, still too short: said again
    assert credits == [("r", [0], 0, True)] * 2 and calls == []
    ready.append(True)
    _new_input(fake)
    assert [c[0] for c in calls] == ["start"] and len(credits) == 2
    fake.report_use("r", [0], 0, waiting=True)  # the started request runs out of input: said again
    assert credits[2:] == [("r", [0], 0, True)]


def test_kv_reservation_counts_each_cache_groups_own_blocks():
    """Groups of 16- and 32-token blocks in one pool (the scheduler's block_size is their least
    common multiple, 32): a request of 1022 tokens takes 64 + 32 blocks; a pool of 4 such requests
    admits 4, not the 6 that 2 x 32 blocks each would."""
    from types import SimpleNamespace

    from omni_server.stage.scheduler import _TakesHiddenCaptures

    def request():
        return SimpleNamespace(num_prompt_tokens=1000, max_tokens=22)

    groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=b)) for b in (16, 32)]
    per_request = -(-1023 // 16) + -(-1023 // 32)
    fake = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=groups), block_size=32, max_model_len=4096,
                           kv_cache_manager=SimpleNamespace(block_pool=SimpleNamespace(num_gpu_blocks=4 * per_request + 1)),
                           running=[], num_waiting_for_streaming_input=0, waiting=[request() for _ in range(8)],
                           skipped_waiting=[])
    assert _TakesHiddenCaptures._admissible(fake) == 4
    fake.running = [request()]
    assert _TakesHiddenCaptures._admissible(fake) == 4  # (1 running + 3 more)


def test_a_stream_window_of_one_still_speaks(tiny_models, tmp_path):
    """The tightest window the config takes: the thinker may run one token ahead of what the talker
    used, and the talker cannot start before the thinker's first reply row, a step past its first
    token. The talker says it waits (before it starts, too), so the reply is spoken, not stuck."""
    import time

    import openai

    from tests.conftest import REPO, Server

    server = Server(REPO / "configs" / "default.yaml", tmp_path / "window1.log",
                    args=["--stage-arg", "talker.stream_window=1"])
    try:
        server.wait_ready(time.monotonic() + 300)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=60, max_retries=0)
        resp = client.chat.completions.create(model="omni-tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=20, modalities=["text", "audio"],
                                              audio={"voice": "Chelsie", "format": "wav"},
                                              extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 20 and resp.choices[0].message.audio.data
    finally:
        assert server.stop() == 0, server.log_tail()


def test_held_requests_keep_their_place_in_the_running_order():
    """A request held out of one schedule() call goes back where it was, not after the requests
    admitted meanwhile: vLLM hands out the step's token budget in `running` order."""
    from omni_server.stage.scheduler import _TakesHiddenCaptures

    a, b, c, new = (SimpleNamespace(name=n) for n in ("a", "b", "c", "new"))

    class Engine:
        def schedule(self):
            assert self.running == [a, c]  # b is held out of this call
            self.running.append(new)  # admitted
            return "scheduled"

    class Sched(_TakesHiddenCaptures, Engine):
        pass

    s = Sched.__new__(Sched)
    s.running, s.held, s.num_waiting_for_streaming_input = [a, b, c], (lambda r: r is b), 0
    assert s._schedule_unheld() == "scheduled"
    assert s.running == [a, b, c, new] and s.num_waiting_for_streaming_input == 0
