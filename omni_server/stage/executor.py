"""The executor of a one-worker stage: vLLM's uniproc executor with a race-free torch.distributed
rendezvous. vLLM picks the worker's TCP port by binding port 0, closing it, and binding it again
later; engines starting together on one host (a pipeline's stages, replicas) can be handed the
same port in between (EADDRINUSE, seen in CI). With one rank nobody else connects to that store,
so the store binds port 0 itself and the OS picks a free port at bind time."""

from __future__ import annotations

from vllm.v1.executor.uniproc_executor import UniProcExecutor


class OneProcessExecutor(UniProcExecutor):
    def _distributed_args(self) -> tuple[str, int, int]:
        _, rank, local_rank = super()._distributed_args()
        return "tcp://127.0.0.1:0", rank, local_rank
