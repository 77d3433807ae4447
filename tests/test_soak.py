"""Soak (slow; `make soak`): 1,000 chat requests at concurrency 32 against the tiny text pipeline, and
300 mixed speech requests (chat with audio, text-only, /v1/audio/speech) against the speech pipeline."""

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


SPEECH_TOTAL, SPEECH_WARMUP = 300, 40


async def _run_speech(base_url: str, ids: range) -> list[int]:
    """Chats with speech (stream and not), text-only chats and /v1/audio/speech, mixed."""
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def one(i: int) -> int:
            async with sem:
                if i % 5 == 4:
                    r = await client.post("/v1/audio/speech", json={
                        "model": "omni-tiny", "input": f"number {i}", "voice": "Ethan", "response_format": "wav"})
                    assert r.content[:4] == b"RIFF"
                    return r.status_code
                body = {"model": "omni-tiny", "max_tokens": 4 + i % 7, "stream": i % 2 == 0,
                        "messages": [{"role": "user", "content": f"request number {i}"}]}
                if i % 5 == 3:
                    body["modalities"] = ["text"]
                if body["stream"]:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        text = "".join([line async for line in r.aiter_lines()])
                        assert "[DONE]" in text and '"error"' not in text
                        return r.status_code
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code != 200 or i % 5 == 3 or r.json()["choices"][0]["message"]["audio"]["data"]
                return r.status_code

        return await asyncio.gather(*(one(i) for i in ids))


def test_soak_speech_pipeline(speech_server):
    codes = asyncio.run(_run_speech(speech_server.base_url, range(SPEECH_WARMUP)))
    rss_warm = _rss(speech_server)
    codes += asyncio.run(_run_speech(speech_server.base_url, range(SPEECH_WARMUP, SPEECH_TOTAL)))
    rss_end = _rss(speech_server)
    assert codes == [200] * SPEECH_TOTAL
    for stage in range(3):
        stats = speech_server.stats(stage)
        assert stats["request_ids"] == [] and stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert rss_end < rss_warm * 1.05, (rss_warm, rss_end)
