"""Soak (slow; `make soak`): 1,000 chat requests at concurrency 32 against the tiny pipeline."""

from __future__ import annotations

import asyncio

import httpx
import psutil
import pytest

pytestmark = pytest.mark.slow

TOTAL, CONCURRENCY, WARMUP = 1000, 32, 100


async def _run(base_url: str, ids: range) -> list[int]:
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        async def one(i: int) -> int:
            body = {"model": "omni-tiny", "max_tokens": 8 + i % 9, "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"request number {i}"}]}
            async with sem:
                if body["stream"]:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        text = "".join([line async for line in r.aiter_lines()])
                        assert "[DONE]" in text and '"error"' not in text
                        return r.status_code
                return (await client.post("/v1/chat/completions", json=body)).status_code

        return await asyncio.gather(*(one(i) for i in ids))


def _rss(server) -> int:
    procs = [psutil.Process(server.proc.pid)] + psutil.Process(server.proc.pid).children(recursive=True)
    return sum(p.memory_info().rss for p in procs)


def test_soak_every_request_answered_nothing_left_behind(text_server):
    codes = asyncio.run(_run(text_server.base_url, range(WARMUP)))
    rss_warm = _rss(text_server)
    codes += asyncio.run(_run(text_server.base_url, range(WARMUP, TOTAL)))
    rss_end = _rss(text_server)
    assert codes == [200] * TOTAL
    stats = text_server.stats(0)
    assert stats["request_ids"] == [] and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert rss_end < rss_warm * 1.05, (rss_warm, rss_end)
