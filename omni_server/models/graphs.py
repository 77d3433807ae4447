"""CUDA graphs of a function of fixed-shape tensors, one per input shape: for model parts outside
vLLM (a generator's networks) whose eager launches cost more than their kernels."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def pow2(rows: int) -> int:
    """`rows` rounded up to a power of two (a bucket of graph batch sizes)."""
    return 1 << (rows - 1).bit_length()


def _same_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with its strides (`clone` makes a view with gaps contiguous; e.g. the DiT's
    masks, whose rows start at aligned offsets for the attention kernels). Expanded views (a
    stride 0 over several elements) are cloned whole."""
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        return t.clone()
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class ShapeGraphs:
    """`fn(*tensors, *options) -> tensor or tuple of tensors`, captured once per `key` (the caller's
    name for the input shapes and options) and replayed after copying the inputs into the
    capture's own. At most `max_graphs`; past that, or after a failed capture, `eager` (default
    `fn`) runs instead.
    All graphs share one memory pool: they never run at the same time, and each keeps its inputs
    and output alive, so no capture reuses another's live tensors (only their dead intermediates)."""

    def __init__(self, fn: Callable[..., torch.Tensor], max_graphs: int, name: str, warm_each: bool = False,
                 eager: Callable[..., torch.Tensor] | None = None):
        self.fn, self.max_graphs, self.name = fn, max_graphs, name
        # eager: what runs outside the graphs, if not `fn` (e.g. `fn` compiled: compiled once for
        # the captured shapes, never again for a shape met while serving).
        self.eager = fn if eager is None else eager
        # warm_each: an eager run before every capture, not just the first (cuDNN builds its plans
        # for a new shape on the host, which it does not promise to be capture-safe).
        self.warm_each = warm_each
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None
        self.failed = False
        self.frozen = False  # set: no more captures (shapes not held run eagerly)

    def _capturing(self) -> bool:
        return not self.failed and not self.frozen and len(self.graphs) < self.max_graphs

    def has_room(self, key_prefix: tuple) -> bool:
        """Whether a key starting with `key_prefix` would replay a graph (held or capturable)."""
        return not self.failed and (self._capturing() or any(k[:len(key_prefix)] == key_prefix for k in self.graphs))

    def run(self, key: tuple, inputs: tuple[torch.Tensor, ...], options: tuple = ()) -> torch.Tensor:
        entry = self.graphs.get(key)
        if entry is None:
            if not self._capturing():
                return self.eager(*inputs, *options)
            stream = torch.cuda.current_stream()
            try:
                entry = self.graphs[key] = self._capture(inputs, options)
            except RuntimeError:  # keep serving, eagerly, and say why once
                log.exception("%s: CUDA graph capture failed; running eagerly from now on", self.name)
                self.failed = True
                torch.cuda.set_stream(stream)  # a failed capture's exit does not restore it
                torch.cuda.synchronize()
                return self.eager(*inputs, *options)
        graph, static, out = entry
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        # The next replay of this graph overwrites `out`.
        return out.clone() if isinstance(out, torch.Tensor) else tuple(t.clone() for t in out)

    def warm_run(self, inputs: tuple[torch.Tensor, ...], options: tuple) -> None:
        """The eager run before a capture: it must launch every kernel the capture will, at the
        same shapes (a subclass may run less of a repetitive `fn`)."""
        self.fn(*inputs, *options)

    def _capture(self, inputs, options):
        static = tuple(_same_layout(t) for t in inputs)
        if self.pool is None or self.warm_each:  # an eager run first (lazy inits, workspaces, plans)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.warm_run(static, options)
            torch.cuda.current_stream().wait_stream(side)
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.fn(*static, *options)
        return graph, static, out
