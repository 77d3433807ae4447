"""vLLM GPU worker (EngineArgs.worker_cls) that builds our hidden-state emitting model runner.

vLLM's worker constructs its runner inside `init_device`; we let it, then swap in ours before any
weights or KV cache exist, so the discarded runner only held small buffers.
Kept apart from the CPU worker: importing vLLM's CPU worker replaces torch.cuda.Stream/Event.
"""

from __future__ import annotations

import gc
import logging
import time

import torch
from vllm.v1.worker.gpu_worker import Worker

from omni_server.models import register_vllm_models
from omni_server.stage.prefix_rows import RowsBudget
from omni_server.stage.runner import GPUOmniModelRunner
from omni_server.stage.moe_warmup import warm_fused_moe
from omni_server.stage.sampler_warmup import pin_triton_cache, warm_top_k_top_p

# Worker processes are fresh interpreters: vLLM resolves our model classes here too.
register_vllm_models()
log = logging.getLogger(__name__)


def require_v1(worker) -> None:
    if worker.use_v2_model_runner:
        raise RuntimeError("omni-server stages need vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0")


class GPUOmniWorker(RowsBudget, Worker):
    def init_device(self):
        require_v1(self)
        super().init_device()
        pin_triton_cache(self.device.index or 0)
        self.model_runner = None
        gc.collect()
        torch.cuda.empty_cache()
        self.model_runner = GPUOmniModelRunner(self.vllm_config, self.device)

    def compile_or_warm_up_model(self):
        # Before vLLM's own warm-up, which ends by arming its JIT monitor (these are expected).
        # Timed apart: ~20 s on the H200 when Triton compiles them, 0 s from the cache (the
        # directory `pin_triton_cache` fixed at init_device).
        t0 = time.monotonic()
        if not self.model_runner.is_pooling_model:
            sched = self.scheduler_config
            warm_top_k_top_p(self.model_config.get_vocab_size(),
                             min(sched.max_num_seqs, sched.max_num_batched_tokens), self.device)
        t1 = time.monotonic()
        moe = warm_fused_moe(self.model_runner, self.scheduler_config.max_num_batched_tokens)
        t2 = time.monotonic()
        out = super().compile_or_warm_up_model()
        capture = self.model_runner.capture_s
        log.info("warm-up: top-k/top-p kernels %.1f s, fused-MoE kernels %.1f s (%d token counts), vLLM's "
                 "dummy runs and kernel warm-up %.1f s, CUDA graph capture %.1f s", t1 - t0, t2 - t1, moe,
                 time.monotonic() - t2 - capture, capture)
        return out
