"""Stage replicas (tests/configs/replicas.yaml: one thinker, two talker and two token2wav processes):
requests spread over the least-loaded replicas, payloads and credits reach the replica serving the
request, results do not depend on the replica, and a dead replica is routed around and restarted."""

from __future__ import annotations

import base64
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

MODEL = "omni-tiny"
CASES = [("Tell me a story.", 1), ("What is two plus two?", 2), ("Describe a cat.", 3), ("Sing.", 4)]


@pytest.fixture(scope="module")
def client(replicas_server):
    return openai.OpenAI(base_url=f"{replicas_server.base_url}/v1", api_key="x", max_retries=0)


def _speak(client, text: str, seed: int):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=10, temperature=0, seed=seed,
        modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16"})
    audio = r.choices[0].message.audio
    return audio.transcript, r.model_extra["omni_outputs"]["talker"]["token_ids"], base64.b64decode(audio.data)


def _replica_steps(server, stage_id: int) -> list[int]:
    return [r["steps"] for r in server.stats(stage_id)["replicas"]]


def test_requests_spread_over_replicas_and_equal_each_alone(client, replicas_server):
    health = httpx.get(f"{replicas_server.base_url}/health").json()
    assert health["stages"] == {"thinker": "ready", "talker": "ready", "token2wav": "ready"}
    assert set(health["pids"]) == {"thinker", "talker#0", "talker#1", "token2wav#0", "token2wav#1"}
    alone = [_speak(client, *c) for c in CASES]  # one at a time: all on replica 0 (ties go low)
    talker, vocoder = _replica_steps(replicas_server, 1), _replica_steps(replicas_server, 2)
    with ThreadPoolExecutor(len(CASES)) as pool:
        together = list(pool.map(lambda c: _speak(client, *c), CASES))
    for (text_a, codes_a, pcm_a), (text_b, codes_b, pcm_b) in zip(alone, together):
        assert text_a == text_b and codes_a == codes_b and pcm_a
        # Together, token2wav batches the streams in one DiT pass: equal up to float rounding.
        a, b = np.frombuffer(pcm_a, "<i2").astype(int), np.frombuffer(pcm_b, "<i2").astype(int)
        assert a.shape == b.shape and np.abs(a - b).max() <= 2
    # In flight together, the requests were split: replica 1 of each stage did work.
    assert _replica_steps(replicas_server, 1)[1] > talker[1]
    assert _replica_steps(replicas_server, 2)[1] > vocoder[1]
    assert all(not r["request_ids"] for i in range(3) for r in replicas_server.stats(i)["replicas"])


def test_dead_replica_is_routed_around_then_restarted(client, replicas_server):
    base = replicas_server.base_url
    pid = httpx.get(f"{base}/health").json()["pids"]["talker#1"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and httpx.get(f"{base}/health").json()["stages"]["talker"] != "degraded":
        time.sleep(0.1)
    health = httpx.get(f"{base}/health")
    assert health.status_code == 200 and health.json()["stages"]["talker"] == "degraded"
    with ThreadPoolExecutor(2) as pool:  # both go to the live replica
        outs = list(pool.map(lambda c: _speak(client, *c), CASES[:2]))
    assert all(o[2] for o in outs)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        h = httpx.get(f"{base}/health").json()
        if h["stages"]["talker"] == "ready":
            break
        time.sleep(0.5)
    assert h["stages"]["talker"] == "ready" and h["pids"]["talker#1"] != pid
