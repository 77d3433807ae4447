"""Generation stage: a registered generator (e.g. a vocoder) run on requests whose inputs are ready.

Requests run one per step, oldest first; between steps the loop drains the socket, so aborts and new
inputs are seen after every request. The result goes to the api as one delta carrying the waveform.
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
from omni_server.wire.messages import ExpectRequest, RequestDelta, RequestOutputs
from omni_server.wire.transport import StageSockets

log = logging.getLogger(__name__)

# The request option naming the generator's voice (None: the generator's default).
VOICE_OPTION = "voice"


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

    def start(self, expect: ExpectRequest, stage_input: StageInput) -> None:
        self.ready[expect.request_id] = (expect, stage_input)

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.ready.pop(rid, None)

    def step(self) -> None:
        rid, (expect, stage_input) = self.ready.popitem(last=False)
        try:
            wave = self.generator(**(stage_input.data or {}), voice=expect.options.get(VOICE_OPTION),
                                  seed=expect.sampling.seed)
        except ValueError as e:  # this request's input or options are invalid
            self.fail(rid, f"stage {self.stage.name}: {e}", code=400)
            return
        except Exception as e:
            log.exception("stage %d: generator failed for %s", self.stage_id, rid)
            self.fail(rid, f"stage {self.stage.name}: generation failed: {e}")
            return
        wave = wave.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        self.sockets.send_api(RequestOutputs(stage_id=self.stage_id, deltas=[RequestDelta(
            request_id=rid, finished=True, finish_reason="stop", tensors={"audio": wave},
            sample_rate=self.generator.sample_rate)]))
