"""vLLM CPU worker (EngineArgs.worker_cls) that builds our hidden-state emitting model runner.

Only imported on CPU hosts: vLLM's CPU worker module replaces torch.cuda.Stream/Event on import.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from omni_server.stage.prefix_rows import RowsBudget
from omni_server.stage.runner import HiddenStatesEmitter, StepEmbedsAdder, StepPredictor, UpstreamPositions
from omni_server.models import register_vllm_models

# Worker processes are fresh interpreters: vLLM resolves our model classes here too.
register_vllm_models()


class CPUOmniModelRunner(UpstreamPositions, StepEmbedsAdder, StepPredictor, HiddenStatesEmitter, CPUModelRunner):
    pass


class CPUOmniWorker(RowsBudget, CPUWorker):
    def init_device(self):
        if self.use_v2_model_runner:
            raise RuntimeError("omni-server stages need vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0")
        super().init_device()
        self.model_runner = CPUOmniModelRunner(self.vllm_config, torch.device("cpu"))
