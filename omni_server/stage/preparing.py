"""Request preparation on a worker thread, off the stage's loop.

vLLM's multimodal processor (resizing and patching images, audio features, video frames) takes
from milliseconds to seconds per request; on the loop it would hold every running request's steps
that long (a 4096x4096 image: ~0.6 s on an H200's host). One worker, jobs in arrival order:
vLLM's processor cache (sending side) and the engine's cache (receiving side) must see requests in
one order, since an item a later request repeats is sent once; a job that ran keeps both sides in
step even when its request is dropped before it enters the engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Preparer:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # (started with the first job)
        self._jobs: OrderedDict[str, Future] = OrderedDict()
        self._dropped: list[Future] = []  # jobs forgotten while they ran (still touching vLLM's state)

    def submit(self, request_id: str, job: Callable[[], Any]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")
        self._jobs[request_id] = self._pool.submit(job)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._jobs

    def ids(self) -> set[str]:
        return set(self._jobs)

    def idle(self) -> bool:
        """No job queued or running (one dropped while running included): the loop thread may use
        vLLM's input processing itself."""
        self._dropped = [job for job in self._dropped if not job.done()]
        return not self._jobs and not self._dropped

    def done(self) -> list[tuple[str, Future]]:
        """The finished jobs at the head of the queue, in arrival order (their futures are done)."""
        out = []
        while self._jobs:
            request_id, job = next(iter(self._jobs.items()))
            if not job.done():
                break
            self._jobs.popitem(last=False)
            out.append((request_id, job))
        return out

    def cancel(self, request_id: str) -> None:
        """Forget the request's job: one not started never runs; a running one's result is dropped."""
        job = self._jobs.pop(request_id, None)
        if job is not None and not job.cancel():
            self._dropped.append(job)

    def close(self) -> None:
        """Cancel what has not started and wait for a running job (before the engine it uses goes)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._jobs.clear()
