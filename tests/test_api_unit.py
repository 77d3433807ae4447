"""The HTTP layer without stages: auth, limits, health and error shapes (real sockets, no engines)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from omni_server.api.app import ServerState, create_app
from omni_server.config import load_config_text
from omni_server.orchestrator.orchestrator import Orchestrator
from tests.conftest import MODELS

CONFIG = """
model: m
stages:
  - {id: 0, name: thinker, model: %s, output: text}
server: {api_key: sekret, max_request_bytes: 4096, max_concurrent_requests: 2}
runtime_dir: %s
"""


@pytest.fixture()
def client(tiny_models, tmp_path):
    cfg = load_config_text(CONFIG % (MODELS / "tiny-qwen2_5-omni", tmp_path))
    state = ServerState(cfg, lambda: Orchestrator(cfg, tmp_path))
    with TestClient(create_app(state)) as c:
        c.server_state = state
        yield c


AUTH = {"authorization": "Bearer sekret"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_api_key_guards_v1(client):
    assert client.get("/v1/models").status_code == 401
    r = client.get("/v1/models", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = client.get("/v1/models", headers=AUTH)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"


def test_health_is_503_while_stages_are_not_ready(client):
    r = client.get("/health")  # no auth needed
    assert r.status_code == 503
    assert r.json() == {"status": "unavailable", "stages": {"thinker": "starting"}, "pids": {}}


def test_chat_is_503_until_the_pipeline_is_up(client):
    r = client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable"


def test_oversized_body_is_413(client):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = client.post("/v1/chat/completions", json=big, headers=AUTH)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


def test_oversized_chunked_body_without_length_is_413(client):
    def chunks():
        for _ in range(10):
            yield b'{"model": "m", "pad": "' + b"x" * 1000 + b'", '
    r = client.post("/v1/chat/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and "exceeds 4096 bytes" in r.json()["error"]["message"]


def test_unknown_route_is_openai_shaped_404(client):
    r = client.get("/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and "error" in r.json()


def test_overload_is_429_with_retry_after(client):
    from omni_server.orchestrator.orchestrator import RequestState

    orch = client.server_state.orch
    for i in range(2):  # two requests in flight: the configured limit
        orch.requests[f"busy-{i}"] = RequestState(f"busy-{i}", {0})
    r = client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    del orch.requests["busy-0"]
    assert client.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 503  # under the limit


SPEECH = """
model: m
stages:
  - {id: 0, name: thinker, model: %s, output: text}
  - {id: 1, name: talker, model: %s, inputs: [0], input_processor: hidden_to_embeds,
     default_sampling: {temperature: 0.9, top_k: 40}}
  - {id: 2, name: token2wav, kind: generation, generator: qwen2_5_omni.token2wav, model: %s, inputs: [1],
     input_processor: qwen2_5_omni.talker_to_token2wav, output: audio}
runtime_dir: %s
"""


def test_a_request_seed_seeds_every_stage(tiny_models, tmp_path):
    """A sampling talker draws from the request's seed too, not only the thinker and the vocoder:
    otherwise the same seed gives other codes, so another waveform."""
    from omni_server.api.app import _sampling
    from omni_server.api.protocol import ChatCompletionRequest

    m = MODELS / "tiny-qwen2_5-omni"
    cfg = load_config_text(SPEECH % (m, m, m, tmp_path))
    state = ServerState(cfg, lambda: Orchestrator(cfg, tmp_path))
    seeded = _sampling(state, ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], seed=7))
    assert {i: spec.seed for i, spec in seeded.items()} == {0: 7, 1: 7, 2: 7}
    assert seeded[1].temperature == 0.9  # (the talker's own sampling, seeded)
    unseeded = _sampling(state, ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]))
    assert {spec.seed for spec in unseeded.values()} == {None}


def test_logprobs_need_a_text_output_and_logprobs_true(tiny_models, tmp_path):
    """Checked before the pipeline is asked: top_logprobs alone, or logprobs from a pipeline whose
    output has no text tokens, is a 400 naming the field."""
    cfg = load_config_text(CONFIG.replace("output: text", "output: tokens") % (MODELS / "tiny-qwen2_5-omni", tmp_path))
    state = ServerState(cfg, lambda: Orchestrator(cfg, tmp_path))
    with TestClient(create_app(state)) as c:
        for body, param in (({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs")):
            r = c.post("/v1/chat/completions", json={**CHAT, **body}, headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert c.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 503  # (no stages up)


def test_transcription_needs_a_stage_that_takes_audio(tiny_models, tmp_path):
    text = CONFIG.replace("output: text}", "output: text, engine_args: {limit_mm_per_prompt: {image: 1, audio: 0}}}")
    cfg = load_config_text(text % (MODELS / "tiny-qwen2_5-omni", tmp_path))
    with TestClient(create_app(ServerState(cfg, lambda: Orchestrator(cfg, tmp_path)))) as c:
        r = c.post("/v1/audio/transcriptions", data={"model": "m"}, files={"file": ("a.wav", b"RIFF", "audio/wav")},
                   headers=AUTH)
    assert r.status_code == 400 and "takes no audio input" in r.json()["error"]["message"]


def test_transcription_upload_counts_toward_the_body_limit(client):
    r = client.post("/v1/audio/transcriptions", data={"model": "m"}, files={"file": ("a.wav", b"x" * 5000, "audio/wav")},
                    headers=AUTH)
    assert r.status_code == 413
