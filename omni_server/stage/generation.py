"""Generation stage: a registered generator (e.g. a vocoder) run on requests whose inputs are ready.

Full input (`input_mode: full`): each step takes the oldest ready requests, up to the stage's
`max_batch_size`, in one generator pass, and sends each result as one delta.
Streamed input (`input_mode: stream`): each request is a generator stream fed everything received
so far; each step advances up to `max_batch_size` streams that can make progress by one piece, in
one pass, and sends each new piece of audio as it is settled, the last one with `finished`. Which
streams a pass takes: those whose listeners are furthest behind first (stream_order.py).
Between steps the loop drains the socket, so aborts and new inputs are seen after every pass.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from omni_server.config.schema import PipelineConfig
from omni_server.stage import generators, stream_order
from omni_server.stage.base import Stage
from omni_server.stage.errors import RequestError, server_fault
from omni_server.stage.processors import StageInput
from omni_server.wire.messages import SPEED_OPTION, VOICE_OPTION, ExpectRequest, RequestDelta
from omni_server.wire.transport import StageSockets

log = logging.getLogger(__name__)


def preload(cfg: PipelineConfig, stage_id: int) -> None:
    """Import the generator's module (transformers' model code) without building it."""
    generators.load(cfg.stage(stage_id).generator)


class GenerationStage(Stage):
    def __init__(self, cfg: PipelineConfig, stage_id: int, sockets: StageSockets):
        t0 = time.monotonic()
        super().__init__(cfg, stage_id, sockets)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.generator = generators.load(self.stage.generator)(str(self.stage.model), device,
                                                               **self.stage.generator_args)
        if self.stage.input_mode == "stream" and not hasattr(self.generator, "open_stream"):
            raise ValueError(f"stage {self.stage.name}: generator {self.stage.generator!r} cannot take "
                             "streamed input; use input_mode: full")
        lead = getattr(self.generator, "stream_lead", 0)
        if self.stage.input_mode == "stream" and lead > self.stage.stream_window:
            raise ValueError(f"stage {self.stage.name}: stream_window {self.stage.stream_window} is below the "
                             f"{lead} input tokens the generator reads ahead; raise it")
        self.ready: OrderedDict[str, tuple[ExpectRequest, StageInput]] = OrderedDict()
        self.streams: OrderedDict[str, Any] = OrderedDict()
        # Streamed requests' sources (backpressure credits).
        self.sources: dict[str, list[int]] = {}
        self.playback = stream_order.Playback()
        self.speeds: dict[str, float] = {}  # request id -> its listener's speed (SPEED_OPTION), when not 1
        # Recent streamed passes' seconds, the longest (decaying): how long a stream left out may wait.
        self._pass_s = 0.0
        self.startup_s = time.monotonic() - t0

    def info(self) -> dict[str, str]:
        return {"voices": ",".join(self.generator.voices), "sample_rate": str(self.generator.sample_rate)}

    def has_work(self) -> bool:
        return bool(self.ready) or any(self.generator.stream_ready(s) for s in self.streams.values())

    def known_requests(self) -> set[str]:
        return set(self.waiting) | set(self.ready) | set(self.streams)

    def counts(self) -> tuple[int, int]:
        # Whole inputs queued for the generator run in its next steps (as vLLM's running requests
        # do); those still awaiting input wait.
        return len(self.streams) + len(self.ready), len(self.waiting)

    def start(self, expect: ExpectRequest, stage_input: StageInput, final: bool = True) -> None:
        rid = expect.request_id
        if self.stage.input_mode == "full":
            self.ready[rid] = (expect, stage_input)
            return
        try:
            stream = self.generator.open_stream(expect.options.get(VOICE_OPTION), expect.sampling.seed)
        except RequestError as e:  # (its voice, say)
            self.fail(rid, f"stage {self.stage.name}: {e}", code=400)
            return
        self.streams[rid] = stream
        self.sources[rid] = list(expect.sources)
        if SPEED_OPTION in expect.options:
            self.speeds[rid] = float(expect.options[SPEED_OPTION])
        self.playback.open(rid, time.monotonic())
        stream.feed(final=final, **(stage_input.data or {}))
        self._report_use(rid, stream)

    def extend(self, request_id: str, stage_input: StageInput, final: bool) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.feed(final=final, **(stage_input.data or {}))
            self.input_arrived(request_id)
            self._report_use(request_id, stream)

    def _report_use(self, rid: str, stream) -> None:
        waiting = not stream.done and not self.generator.stream_ready(stream)
        self.report_use(rid, self.sources.get(rid, []), stream.consumed, waiting)

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.ready.pop(rid, None)
            self.streams.pop(rid, None)
            self.sources.pop(rid, None)
            self.speeds.pop(rid, None)
            self.playback.forget(rid)
            self.forget_use(rid)

    def step(self) -> int:
        served = 0
        if self.ready:
            served += self._step_full()
        if self.streams:
            served += self._step_streams()
        return served

    def _step_full(self) -> int:
        batch = [self.ready.popitem(last=False) for _ in range(min(self.stage.max_batch_size, len(self.ready)))]
        requests = [{**(inp.data or {}), "voice": exp.options.get(VOICE_OPTION), "seed": exp.sampling.seed}
                    for _, (exp, inp) in batch]
        rids = [rid for rid, _ in batch]
        try:
            waves = self.generator.batch(requests)
        except Exception as e:  # the pass itself failed: every request in it fails
            self._fail_pass(rids, e)
            return len(rids)
        self._send(rids, waves, [True] * len(rids), [_num_codes(inp.data) for _, (_, inp) in batch])
        return len(rids)

    def _step_streams(self) -> int:
        ready = [rid for rid, s in self.streams.items() if self.generator.stream_ready(s)]
        if not ready:
            return 0
        now = time.monotonic()
        slack = {rid: self.playback.slack(rid, now) for rid in ready}
        # A stream left out waits for this pass and then its own: it needs two passes of audio ahead
        # (passes of any size: the longest of late).
        rids = stream_order.pick(ready, slack, self.stage.max_batch_size,
                                 getattr(self.generator, "stream_batch_sizes", None), 2 * self._pass_s)
        streams = [self.streams[rid] for rid in rids]
        read = [_num_codes(vars(s)) for s in streams]  # (before the step: a finished stream may let its codes go)
        try:
            pieces = self.generator.stream_step(streams)
        except Exception as e:
            self._fail_pass(rids, e)
            return len(rids)
        self._pass_s = max(time.monotonic() - now, 0.9 * self._pass_s)
        # Sent before the finished ones are dropped (their last piece still counts in the playback model).
        self._send(rids, pieces, [s.done for s in streams], read)
        for rid, stream in zip(rids, streams):
            if stream.done:
                self.drop([rid])
            elif rid in self.streams:  # (not failed in _send)
                self._report_use(rid, stream)
        return len(rids)

    def _fail_pass(self, rids: list[str], e: Exception) -> None:
        log.exception("stage %d: generator failed on %d requests", self.stage_id, len(rids))
        for rid in rids:
            self.fail(rid, server_fault(f"stage {self.stage.name}: generation failed", e))

    def _send(self, rids: list[str], waves: list, finished: list[bool], inputs: list[int]) -> None:
        deltas = []
        for rid, wave, done, n_in in zip(rids, waves, finished, inputs):
            if isinstance(wave, ValueError):  # this request's input or options are invalid
                self.streams.pop(rid, None)
                # Input that came from an upstream stage is the server's fault, not the client's;
                # the request's own options (RequestError) are the client's.
                if self.stage.inputs and not isinstance(wave, RequestError):
                    log.warning("stage %d: %s: input from upstream rejected: %s", self.stage_id, rid, wave)
                    self.fail(rid, server_fault(f"stage {self.stage.name}: rejected its input from upstream", wave))
                else:
                    self.fail(rid, f"stage {self.stage.name}: {wave}", code=400)
                continue
            wave = wave.detach().to("cpu", torch.float32).reshape(-1).contiguous()
            if not done and wave.numel() == 0:
                continue
            # (played at the request's speed: /v1/audio/speech's `speed`, stretched by the api)
            seconds = wave.numel() / self.generator.sample_rate / self.speeds.get(rid, 1.0)
            dry = self.playback.sent(rid, seconds, time.monotonic())
            if dry > 0:  # this stream's listener ran out of audio before this piece (server-side view)
                self.underruns += 1
                self.underrun_s += dry
            # A generation stage's "prompt" is the tokens it decoded (e.g. codec codes): usage counts them.
            deltas.append(RequestDelta(request_id=rid, finished=done, finish_reason="stop" if done else None,
                                       tensors={"audio": wave}, sample_rate=self.generator.sample_rate,
                                       num_prompt_tokens=n_in if done else 0))
        if deltas:
            self.send_outputs(deltas)


def _num_codes(data: dict | None) -> int:
    """Code positions (frames) in a request's codes: their last dimension (a frame of several
    codebooks, [codebooks, frames], counts once)."""
    codes = (data or {}).get("codes")
    if codes is None:
        return 0
    codes = torch.as_tensor(codes)
    return int(codes.shape[-1]) if codes.dim() else 1
