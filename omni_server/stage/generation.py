"""Generation stage: a registered generator (e.g. a vocoder) run on requests whose inputs are ready.

Each step takes the oldest ready requests, up to the stage's `max_batch_size`, in one generator pass;
between steps the loop drains the socket, so aborts
and new inputs are seen after every pass. Each result goes to the api as one delta with the waveform.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from omni_server.config.schema import PipelineConfig
from omni_server.stage import generators
from omni_server.stage.base import Stage
from omni_server.stage.processors import StageInput
from omni_server.wire.messages import VOICE_OPTION, ExpectRequest, RequestDelta, RequestOutputs
from omni_server.wire.transport import StageSockets

log = logging.getLogger(__name__)


class GenerationStage(Stage):
    def __init__(self, cfg: PipelineConfig, stage_id: int, sockets: StageSockets):
        t0 = time.monotonic()
        super().__init__(cfg, stage_id, sockets)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.generator = generators.load(self.stage.generator)(str(self.stage.model), device)
        self.ready: OrderedDict[str, tuple[ExpectRequest, StageInput]] = OrderedDict()
        self.startup_s = time.monotonic() - t0

    def info(self) -> dict[str, str]:
        return {"voices": ",".join(self.generator.voices), "sample_rate": str(self.generator.sample_rate)}

    def has_work(self) -> bool:
        return bool(self.ready)

    def known_requests(self) -> set[str]:
        return set(self.waiting) | set(self.ready)

    def counts(self) -> tuple[int, int]:
        return 0, len(self.waiting) + len(self.ready)

    def start(self, expect: ExpectRequest, stage_input: StageInput, final: bool = True) -> None:
        self.ready[expect.request_id] = (expect, stage_input)

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.ready.pop(rid, None)

    def step(self) -> None:
        batch = [self.ready.popitem(last=False) for _ in range(min(self.stage.max_batch_size, len(self.ready)))]
        requests = [{**(inp.data or {}), "voice": exp.options.get(VOICE_OPTION), "seed": exp.sampling.seed}
                    for _, (exp, inp) in batch]
        try:
            waves = self.generator.batch(requests)
        except Exception as e:  # the pass itself failed: every request in it fails
            log.exception("stage %d: generator failed on %d requests", self.stage_id, len(batch))
            for rid, _ in batch:
                self.fail(rid, f"stage {self.stage.name}: generation failed: {e}")
            return
        deltas = []
        for (rid, _), wave in zip(batch, waves):
            if isinstance(wave, ValueError):  # this request's input or options are invalid
                self.fail(rid, f"stage {self.stage.name}: {wave}", code=400)
                continue
            wave = wave.detach().to("cpu", torch.float32).reshape(-1).contiguous()
            deltas.append(RequestDelta(request_id=rid, finished=True, finish_reason="stop", tensors={"audio": wave},
                                       sample_rate=self.generator.sample_rate))
        if deltas:
            self.sockets.send_api(RequestOutputs(stage_id=self.stage_id, deltas=deltas))

