"""Host <-> device transfers that never wait for the model's queued GPU work.

A stage process queues its model's steps on the GPU ahead of time (async scheduling); anything that
synchronises with that stream — `torch.tensor(..., device=cuda)` or a copy from pageable memory (the
driver syncs the stream first), `.cpu()`, `.item()` — stalls the loop until those steps are done and
breaks the overlap. So inputs go through pinned memory (`to_device`, `host_index`) and request-side
device work (input processors) runs `aside`: on a side stream, where its syncs wait for its own
kernels only. A result that stays on the device goes with an event (`handoff`) that its reader's
stream waits for (`receive`): no host sync at all.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` (host) on `device` as `dtype`, copied behind the queued work (from pinned memory) on CUDA."""
    if device.type != "cuda" or t.is_cuda:  # (on the GPU already: see `handoff`)
        return t.to(device, dtype)
    if not t.is_pinned():
        t = t.pin_memory()
    t = t.to(device, non_blocking=True)
    return t if dtype is None else t.to(dtype)


def host_index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index on `device` without stalling it (see `to_device`)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device.index is None:  # one stream per GPU: "cuda" and "cuda:0" name the same one
        device = torch.device("cuda", torch.cuda.current_device())
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            # (PyTorch's streams are non-blocking: no implicit sync with the legacy default stream.)
            stream = _streams[device] = torch.cuda.Stream(device)
        return stream


@contextlib.contextmanager
def aside(device: torch.device) -> Iterator[None]:
    """Run the block's device work on a side stream of `device` (a no-op elsewhere). The block
    must only read device tensors that were complete before it (tables built at start): the side
    stream does not wait for the model's stream, which is the point."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.stream(_side_stream(device)):
        yield


def settle(device: torch.device) -> None:
    """Wait for every stream of `device` (after building tables that `aside` blocks will read)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_host(*ts: torch.Tensor, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Host copies of device tensors `ts` as `dtype`, into pinned memory, queued on the current
    stream (an `aside` block's), and the event after which they are filled (None off a GPU: the
    copies are done). The caller waits for the event where it first reads them."""
    if not ts or ts[0].device.type != "cuda":
        return [t.to("cpu", dtype) for t in ts], None
    out = []
    for t in ts:
        host = torch.empty(t.shape, dtype=dtype, pin_memory=True)
        host.copy_(t.to(dtype), non_blocking=True)
        out.append(host)
    done = torch.cuda.Event()
    done.record()
    return out, done


def handoff(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`t`, made in an `aside` block just before, and the event that marks it done on the side
    stream (None off a GPU). Its reader calls `receive` where it reads it (in a stage, the model
    runner, on the model's stream), so the maker need not know that stream."""
    if t.device.type != "cuda":
        return t, None
    done = torch.cuda.Event()
    done.record(_side_stream(t.device))
    return t, done


def receive(t: torch.Tensor, ready: torch.cuda.Event | None) -> torch.Tensor:
    """`t` for the current stream: its later work waits, on the GPU, for `ready` (no host wait),
    and `t`'s memory is not reused until that work is done."""
    if ready is None:
        return t
    current = torch.cuda.current_stream(t.device)
    current.wait_event(ready)
    t.record_stream(current)
    return t
