"""Process lifecycle on a server of its own: a stage killed mid-request (fails fast, restarts), then
SIGTERM (in-flight requests finish, everything stops). The tests run in file order and share it."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

MODEL = "omni-tiny"
MESSAGES = [{"role": "user", "content": "Keep talking."}]


def test_killed_stage_fails_requests_then_restarts(crash_server):
    base = crash_server.base_url
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    pid = httpx.get(f"{base}/health").json()["pids"]["thinker"]

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1900, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    # a Responses stream too: its failure is OpenAI's `error` event (the SDK raises on it)
    events = iter(client.responses.create(model=MODEL, input="Hi", max_output_tokens=1900, stream=True,
                                          extra_body={"ignore_eos": True}))
    next(events)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError) as err:
        for _ in chunks:
            pass
    assert time.monotonic() - killed < 2.0
    assert "thinker" in str(err.value) and "unavailable" in str(err.value)
    with pytest.raises(openai.APIError, match="unavailable"):
        for _ in events:
            pass

    health = httpx.get(f"{base}/health")
    assert health.status_code == 503 and health.json()["stages"]["thinker"] in ("down", "starting")
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        h = httpx.get(f"{base}/health")
        if h.status_code == 200:
            break
        time.sleep(1)
    assert h.status_code == 200, h.json()
    assert h.json()["pids"]["thinker"] != pid
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    assert resp.usage.completion_tokens >= 1


def _wait_health(base, predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(f"{base}/health", timeout=5).json()
        if predicate(h):
            return h
        time.sleep(0.5)
    raise AssertionError(f"health never matched: {h}")


def test_hung_stage_is_killed_and_restarted(crash_server):
    base = crash_server.base_url
    pid = httpx.get(f"{base}/health").json()["pids"]["thinker"]
    os.kill(pid, signal.SIGSTOP)  # alive but silent
    _wait_health(base, lambda h: h["stages"]["thinker"] != "ready", 30)
    h = _wait_health(base, lambda h: h["status"] == "ok", 240)
    assert h["pids"]["thinker"] != pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the hung process was killed, not left behind
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3).usage.completion_tokens >= 1


def test_sigterm_finishes_in_flight_requests_then_stops(crash_server):
    # Streamed so the test knows the request is in flight (first delta seen) before it sends SIGTERM;
    # polling stats raced a fast CI machine that finished 1500 tokens between polls.
    client = openai.OpenAI(base_url=f"{crash_server.base_url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1500, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    crash_server.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest[-1].usage.completion_tokens == 1500
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert crash_server.proc.wait(60) == 0


def test_requests_past_the_shutdown_timeout_end_with_a_503(tiny_models, tmp_path):
    """SIGTERM with requests that outlast server.shutdown_timeout_s: at the deadline uvicorn cancelled
    them (a bare 500 "Internal Server Error" and a traceback each; streams cut without their end,
    held open until the stages stopped). They end with a 503 instead: the whole request's a JSON
    error, a stream's an error event, then [DONE]; serve exits 0 without a traceback."""
    import threading

    from tests.conftest import Server

    config = tmp_path / "c.yaml"
    config.write_text(f"""
model: {MODEL}
stages:
  - id: 0
    name: thinker
    model: {tiny_models["tiny-qwen2_5-omni"]}
    engine_args: {{dtype: float32, max_model_len: 2048, max_num_seqs: 8, enforce_eager: true,
                  kv_cache_memory_bytes: 134217728}}
    env: {{TORCHDYNAMO_DISABLE: "1"}}
    output: text
server: {{shutdown_timeout_s: 2}}
""")
    server = Server(config, tmp_path / "serve.log")
    try:
        server.wait_ready(time.monotonic() + 120)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True}
        whole: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: whole.append(
            httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)))
        worker.start()
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            deadline = time.monotonic() + 30
            while server.stats(0)["num_running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.stats(0)["num_running"] == 2
            server.proc.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        worker.join(30)
        assert events[-1] == "data: [DONE]"
        error = events[-2].removeprefix("data: ")
        assert '"error"' in error and "shutting down" in error and "shutdown_timeout_s (2 s)" in error, events[-3:]
        assert whole[0].status_code == 503 and "shutting down" in whole[0].json()["error"]["message"]
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    log = server.log_tail(200_000)
    assert "Traceback" not in log and "shutting down: 2 request(s) still in flight failed with a 503" in log
