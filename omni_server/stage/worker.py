"""vLLM workers (set through EngineArgs.worker_cls) that build our model runners.

vLLM's workers construct their runner inside `init_device`; we let them, then swap in ours before
any model weights or KV cache exist, so the base runner only held small host/device buffers.
"""

from __future__ import annotations

import gc

import torch
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from omni_server.stage.runner import CPUOmniModelRunner, GPUOmniModelRunner


def _require_v1(worker) -> None:
    if worker.use_v2_model_runner:
        raise RuntimeError("omni-server stages need vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0")


class GPUOmniWorker(Worker):
    def init_device(self):
        _require_v1(self)
        super().init_device()
        self.model_runner = None
        gc.collect()
        torch.cuda.empty_cache()
        self.model_runner = GPUOmniModelRunner(self.vllm_config, self.device)


class CPUOmniWorker(CPUWorker):
    def init_device(self):
        _require_v1(self)
        super().init_device()
        self.model_runner = CPUOmniModelRunner(self.vllm_config, torch.device("cpu"))
