"""The api's orchestrator and a stage's routing against fake stages (real ZMQ sockets, no engines):
restarts, stages that stay down, long requests among many short ones."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
import torch
import zmq
import zmq.asyncio

from omni_server.config import load_config_text
from omni_server.orchestrator import orchestrator as orch_mod
from omni_server.orchestrator.orchestrator import Orchestrator
from omni_server.wire.codec import Decoder, Encoder
from omni_server.wire.messages import (AddRequest, RequestDelta, RequestOutputs, SamplingSpec, StageReady, StageStats,
                                        StatsQuery, StreamCredit)
from omni_server.wire.transport import api_address, stage_address
from tests.conftest import MODELS

CONFIG = """
model: m
stages:
  - {id: 0, name: thinker, model: %s, output: text, replicas: %d}
server: {stage_timeout_s: 30}
runtime_dir: %s
"""


def _config(tmp_path, replicas: int = 1):
    return load_config_text(CONFIG % (MODELS / "tiny-qwen2_5-omni", replicas, tmp_path))


class FakeStage:
    """A stage process's sockets: its input (PULL) and its output to the api (PUSH)."""

    def __init__(self, ctx, cfg, runtime_dir, pid: int, boot: int, replica: int = 0, stage_id: int = 0):
        self.pid, self.boot, self.replica, self.stage_id = pid, boot, replica, stage_id
        self.enc, self.dec = Encoder(), Decoder()
        self.input = ctx.socket(zmq.PULL)
        self.input.bind(stage_address(cfg, stage_id, runtime_dir, replica))
        self.out = ctx.socket(zmq.PUSH)
        self.out.connect(api_address(cfg, runtime_dir))

    async def ready(self) -> None:
        await self.out.send_multipart(self.enc.encode(StageReady(stage_id=self.stage_id, pid=self.pid, startup_s=1.0,
                                                                 replica=self.replica, boot=self.boot)))

    async def send(self, *deltas: RequestDelta) -> None:
        await self.out.send_multipart(self.enc.encode(RequestOutputs(stage_id=self.stage_id, deltas=list(deltas))))

    async def serve(self, seconds: float) -> list:
        """Answer probes for a while; return what else arrived."""
        got, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            if await self.input.poll(50):
                msg = self.dec.decode(await self.input.recv_multipart())
                if isinstance(msg, StatsQuery):
                    await self.out.send_multipart(self.enc.encode(StageStats(
                        stage_id=self.stage_id, nonce=msg.nonce, num_running=0, num_waiting=0, request_ids=[], pid=self.pid,
                        replica=self.replica, boot=self.boot)))
                else:
                    got.append(msg)
        return got

    def close(self) -> None:
        self.input.close(linger=0)
        self.out.close(linger=0)


async def _one_stage(tmp_path, ctx):
    """An orchestrator of a one-stage config and that stage, ready."""
    cfg = _config(tmp_path)
    orch = Orchestrator(cfg, tmp_path)
    orch.start()
    stage = FakeStage(ctx, cfg, tmp_path, pid=7, boot=1)
    await stage.ready()
    await orch.wait_ready(5)
    return orch, stage


def _ended(orch: Orchestrator, outcome: str) -> float:
    """Requests /metrics counts as ended with `outcome`."""
    return orch.metrics.requests.labels(model="m", outcome=outcome)._value.get()


def test_a_stage_restarted_at_its_address_fails_the_requests_it_held(tmp_path):
    """An external stage that comes back (docker's restart policy, the same pid in its container)
    within stage_timeout_s: the requests the old process held fail with a 503 at once instead of
    waiting forever, and the new process serves."""

    async def main():
        ctx = zmq.asyncio.Context()
        orch, old = await _one_stage(tmp_path, ctx)
        cfg = orch.cfg
        try:
            state = await orch.submit("r1", [1, 2, 3], {0: SamplingSpec()})
            assert [type(m).__name__ for m in await old.serve(0.3)] == ["AddRequest"]
            old.close()
            new = FakeStage(ctx, cfg, tmp_path, pid=7, boot=2)  # (not its StageReady: a probe finds it)
            await new.serve(5)  # (probes come each second; slack for a busy host)
            stage_id, delta = await asyncio.wait_for(state.queue.get(), 1)
            assert stage_id == 0 and delta.finished and delta.error_code == 503
            assert "restarted" in delta.error
            assert orch.ready[(0, 0)].boot == 2 and orch.serving
            new.close()
        finally:
            await orch.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_aborts_and_probes_never_wait_on_a_replica_that_stays_down(tmp_path, monkeypatch, caplog):
    """A replica given up (or an external stage gone) reads nothing: once its send queue is full,
    aborts (in every failing request's path) and the probes go on without waiting for it."""
    monkeypatch.setattr(orch_mod, "SEND_HWM", 20)

    async def main():
        cfg = _config(tmp_path, replicas=2)
        orch = Orchestrator(cfg, tmp_path)
        ctx = zmq.asyncio.Context()
        alive = FakeStage(ctx, cfg, tmp_path, pid=5, boot=5)  # replica 0; replica 1 never binds
        try:
            for i in range(500):  # far past both queues' 20
                await asyncio.wait_for(orch.abort(f"gone-{i}"), 1)
                await orch._send_or_drop((0, 1), StatsQuery(nonce=0))
            got = await alive.serve(0.5)
            assert got and all(type(m).__name__ == "AbortRequest" for m in got)
        finally:
            alive.close()
            await orch.close()
            ctx.destroy(linger=0)
        # The api stopping: streams its graceful shutdown cancels abort after the sockets closed.
        with caplog.at_level(logging.DEBUG, logger=orch_mod.log.name):
            await asyncio.wait_for(orch.abort("late"), 1)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text

    asyncio.run(main())


def test_routes_of_requests_still_here_outlive_many_later_ones(tmp_path, monkeypatch):
    """A stage remembers a bounded number of routes (which replica downstream serves a request):
    the oldest that ended go first, never one still in flight, whose payloads and credits must
    keep reaching its own replica."""
    from omni_server.stage import base

    monkeypatch.setattr(base, "MAX_ROUTES", 3)
    cfg = load_config_text(f"""
model: m
stages:
  - {{id: 0, name: a, model: {MODELS / 'tiny-qwen2_5-omni'}, output: text}}
  - {{id: 1, name: b, model: {MODELS / 'tiny-qwen2_5-omni'}, inputs: [0], replicas: 2, input_processor: hidden_to_embeds}}
runtime_dir: {tmp_path}
""")
    sent = []
    sockets = SimpleNamespace(replica=0, send_stage=lambda sid, msg, replica: sent.append((msg.request_id, replica)),
                              send_api=lambda msg: None)
    stage = base.Stage(cfg, 0, sockets)
    live = {"long"}
    stage.add_prompt = lambda msg: None
    stage.known_requests = lambda: set(live)

    def add(rid: str, replica: int) -> None:
        stage._handle(AddRequest(request_id=rid, prompt_token_ids=[1], sampling=SamplingSpec(), forward_to=[1],
                                 replicas={0: 0, 1: replica}))

    add("long", 1)
    for i in range(10):  # later requests, ended here
        add(f"r{i}", 0)
    assert len(stage.routes) == 3 and "long" in stage.routes and "r9" in stage.routes
    stage.send_stage(1, "long", StreamCredit(request_id="long", stage_id=0, consumed=1))
    assert sent[-1] == ("long", 1)


SPEECH = """
model: m
stages:
  - {id: 0, name: thinker, model: %(m)s, output: text}
  - {id: 1, name: talker, model: %(m)s, inputs: [0], input_processor: qwen2_5_omni.thinker_to_talker}
  - {id: 2, name: token2wav, kind: generation, model: %(m)s, generator: qwen2_5_omni.token2wav, inputs: [1],
     input_processor: qwen2_5_omni.talker_to_token2wav, output: audio}
server: {stage_timeout_s: 30}
runtime_dir: %(dir)s
"""


async def _close(orch, stages, ctx) -> None:
    for s in stages:
        s.close()
    await orch.close()
    ctx.destroy(linger=0)


async def _speech_pipeline(tmp_path, ctx):
    cfg = load_config_text(SPEECH % {"m": MODELS / "tiny-qwen2_5-omni", "dir": tmp_path})
    orch = Orchestrator(cfg, tmp_path)
    orch.start()
    stages = [FakeStage(ctx, cfg, tmp_path, pid=10 + i, boot=i, stage_id=i) for i in range(3)]
    for s in stages:
        await s.ready()
    await orch.wait_ready(5)
    return orch, stages


def test_a_stage_down_refuses_only_the_requests_whose_route_it_is_on(tmp_path):
    """Text-only requests go on while an audio stage is down (restarting, or given up); speech waits."""

    async def main():
        ctx = zmq.asyncio.Context()
        orch, stages = await _speech_pipeline(tmp_path, ctx)
        try:
            orch.mark_down((2, 0), "process exited with code -9")
            assert not orch.serving  # (/health: the pipeline as a whole is degraded)
            state = await orch.submit("text", [1, 2], {0: SamplingSpec()}, outputs={"text"})
            assert state.replicas == {0: 0}
            with pytest.raises(orch_mod.StageUnavailable, match="token2wav"):
                await orch.submit("speech", [1, 2], {i: SamplingSpec() for i in range(3)}, outputs={"text", "audio"})
        finally:
            await _close(orch, stages, ctx)

    asyncio.run(main())


@pytest.mark.parametrize("talker_done", [True, False])
def test_a_stage_that_dies_after_its_part_fails_only_what_may_still_need_it(tmp_path, talker_done):
    """The thinker dies while a reply's audio still streams from token2wav: with the talker done
    too (it had all the thinker sent) the reply goes on to its end; with the talker still running
    (it may lack a payload the thinker had queued) the request fails at once (503)."""

    async def main():
        ctx = zmq.asyncio.Context()
        orch, (thinker, talker, t2w) = await _speech_pipeline(tmp_path, ctx)
        try:
            state = await orch.submit("r", [1, 2], {i: SamplingSpec() for i in range(3)}, outputs={"text", "audio"})
            deltas = orch.deltas(state)
            await thinker.send(RequestDelta("r", new_token_ids=[5], finished=True, finish_reason="stop"))
            assert (await asyncio.wait_for(anext(deltas), 2))[0] == 0
            if talker_done:
                await talker.send(RequestDelta("r", finished=True, finish_reason="stop"))
            await t2w.send(RequestDelta("r", tensors={"audio": torch.zeros(10)}, sample_rate=24000))
            assert (await asyncio.wait_for(anext(deltas), 2))[0] == 2  # (the talker's finish is not the client's)
            deadline = time.monotonic() + 2  # (the talker's finish came on another connection)
            while len(state.finished) < 1 + talker_done and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert state.finished == ({0, 1} if talker_done else {0})
            orch.mark_down((0, 0), "process exited with code -9")
            if talker_done:
                await t2w.send(RequestDelta("r", tensors={"audio": torch.zeros(10)}, sample_rate=24000, finished=True,
                                            finish_reason="stop"))

            async def rest():
                return [(i, d) async for i, d in deltas]

            got = await asyncio.wait_for(rest(), 5)
            errors = [d for _, d in got if d.error is not None]
            if talker_done:
                assert not errors and got[-1][0] == 2 and got[-1][1].finished and state.done
            else:
                assert [e.error_code for e in errors] == [503] and "thinker" in errors[0].error
        finally:
            await _close(orch, (thinker, talker, t2w), ctx)

    asyncio.run(main())


@pytest.mark.parametrize("audio", [True, False])
def test_a_spoken_reply_that_ended_without_audio_counts_as_an_error(tmp_path, audio):
    """The api answers a 500 ("the pipeline returned no audio") when the audio stage finished
    without sending any: /metrics counts that request as an error, not ok."""

    async def main():
        ctx = zmq.asyncio.Context()
        orch, (thinker, talker, t2w) = await _speech_pipeline(tmp_path, ctx)
        count = lambda outcome: _ended(orch, outcome)  # noqa: E731
        try:
            state = await orch.submit("r", [1, 2], {i: SamplingSpec() for i in range(3)}, outputs={"text", "audio"})
            await thinker.send(RequestDelta("r", new_token_ids=[5], finished=True, finish_reason="stop"))
            await talker.send(RequestDelta("r", finished=True, finish_reason="stop"))
            tensors = {"audio": torch.zeros(0)} if audio else {}  # (an empty reply's audio is still audio)
            await t2w.send(RequestDelta("r", tensors=tensors, sample_rate=24000, finished=True, finish_reason="stop"))
            got = await asyncio.wait_for(_drain(orch.deltas(state)), 5)
            assert [i for i, _ in got] == [0, 2] and state.done
            assert (count("ok"), count("error")) == ((1, 0) if audio else (0, 1))
        finally:
            await _close(orch, (thinker, talker, t2w), ctx)

    asyncio.run(main())


async def _drain(deltas) -> list:
    return [(i, d) async for i, d in deltas]


def test_a_request_whose_client_reads_slowly_holds_no_slot_once_the_pipeline_is_done(tmp_path):
    """The concurrency limit counts what the pipeline still works on: a stream whose client stopped
    reading (its last deltas queued here) no longer counts once its last client-facing delta came,
    nor does one that failed; it still counts while any output stage is running."""

    async def main():
        ctx = zmq.asyncio.Context()
        orch, (thinker, talker, t2w) = await _speech_pipeline(tmp_path, ctx)
        try:
            for rid in ("a", "b"):
                await orch.submit(rid, [1, 2], {i: SamplingSpec() for i in range(3)}, outputs={"text", "audio"})
            assert orch.in_flight() == 2

            async def settle(want: int) -> None:
                deadline = time.monotonic() + 5
                while orch.in_flight() != want and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert orch.in_flight() == want

            await thinker.send(RequestDelta("a", new_token_ids=[5], finished=True, finish_reason="stop"))
            await talker.send(RequestDelta("a", finished=True, finish_reason="stop"))
            await settle(2)  # (its audio still comes)
            await t2w.send(RequestDelta("a", tensors={"audio": torch.zeros(10)}, sample_rate=24000, finished=True,
                                        finish_reason="stop"))
            await settle(1)
            await talker.send(RequestDelta("b", finished=True, finish_reason="error", error="boom", error_code=500))
            await settle(0)
            assert set(orch.requests) == {"a", "b"}  # (nobody read their deltas yet)
        finally:
            await _close(orch, (thinker, talker, t2w), ctx)

    asyncio.run(main())


def test_a_request_ends_here_with_its_last_delta_even_if_nobody_reads_on(tmp_path):
    """The api's stream stops reading after the last delta when its client left (the generator is
    never resumed, and the api's run and its stream form a cycle only the garbage collector frees):
    the request is forgotten, its load given back and its outcome counted when that delta comes,
    not when the generator is collected (it stayed in /metrics' in-flight gauge for minutes)."""

    async def main():
        ctx = zmq.asyncio.Context()
        orch, stage = await _one_stage(tmp_path, ctx)
        count = lambda outcome: _ended(orch, outcome)  # noqa: E731
        try:
            state = await orch.submit("r1", [1, 2, 3], {0: SamplingSpec()})
            assert orch.load[(0, 0)] == 1
            await stage.send(RequestDelta("r1", new_token_ids=[5], finished=True, finish_reason="stop"))
            reader = orch.deltas(state)
            _, delta = await asyncio.wait_for(anext(reader), 5)
            assert delta.finished
            # (`reader` is kept, suspended at its last yield)
            assert "r1" not in orch.requests and orch.load[(0, 0)] == 0 and count("ok") == 1
            await reader.aclose()
            assert count("ok") == 1 and count("aborted") == 0  # (counted once)
            state = await orch.submit("r2", [1, 2, 3], {0: SamplingSpec()})
            await stage.send(RequestDelta("r2", finished=True, finish_reason="error", error="boom", error_code=500))
            reader = orch.deltas(state)
            _, delta = await asyncio.wait_for(anext(reader), 5)
            assert delta.error == "boom"
            assert "r2" not in orch.requests and orch.load[(0, 0)] == 0 and count("error") == 1
            # A request a stage refused as the client's error (400) is `invalid`, not the server's error.
            state = await orch.submit("r3", [1, 2, 3], {0: SamplingSpec()})
            await stage.send(RequestDelta("r3", finished=True, finish_reason="error", error="bad", error_code=400))
            _, delta = await asyncio.wait_for(anext(orch.deltas(state)), 5)
            assert delta.error_code == 400 and count("invalid") == 1 and count("error") == 1
        finally:
            stage.close()
            await orch.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_a_stalled_api_does_not_take_its_own_silence_for_the_stages(tmp_path):
    """The api paused past stage_timeout_s (a frozen container, a blocked loop): on resuming it must
    not mark its stages down, failing every request in flight, for answers it did not read or
    probes it did not send (a 35 s pause failed 4 streams; the stages were ready again 2 ms later)."""

    async def main():
        ctx = zmq.asyncio.Context()
        cfg = _config(tmp_path)
        cfg.server.stage_timeout_s = 2.5
        orch = Orchestrator(cfg, tmp_path)
        orch.start()
        stage = FakeStage(ctx, cfg, tmp_path, pid=7, boot=1)
        try:
            await stage.ready()
            await orch.wait_ready(5)
            state = await orch.submit("r1", [1, 2, 3], {0: SamplingSpec()})
            await stage.serve(1.2)
            time.sleep(4.0)  # (the loop blocked: nothing runs, the stage's last answer ages)
            await stage.serve(2.5)
            assert orch.down == {} and orch.serving
            assert state.queue.empty()  # (no error pushed to the request in flight)
        finally:
            stage.close()
            await orch.close()
            ctx.destroy(linger=0)

    asyncio.run(main())
