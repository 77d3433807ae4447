"""The HTTP layer without stages: auth, limits, health and error shapes (real sockets, no engines)."""

from __future__ import annotations

import asyncio
import time
import json

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


def test_api_key_guards_the_realtime_socket(client):
    """/v1/realtime is refused at the handshake without the key (no session event); with it the
    session starts (a text-only pipeline: text out)."""
    from starlette.websockets import WebSocketDisconnect

    for headers in ({}, {"authorization": "Bearer wrong"}):
        with pytest.raises(WebSocketDisconnect) as e:
            with client.websocket_connect("/v1/realtime?model=m", headers=headers) as ws:
                ws.receive_json()
        assert e.value.code == 1008
    with client.websocket_connect("/v1/realtime?model=m", headers=AUTH) as ws:
        created = ws.receive_json()
        assert created["type"] == "session.created" and created["session"]["output_modalities"] == ["text"]


def test_the_key_is_checked_before_the_body_is_read(client):
    """Without the key a body is not even parsed: malformed JSON or an oversized body is a 401, not
    a 400 / 413 (with the key those come back); every /v1 path, unknown ones too."""
    bad = {"content-type": "application/json"}
    assert client.post("/v1/chat/completions", content=b'{"model": "m",', headers=bad).status_code == 401
    assert client.post("/v1/chat/completions", content=b"x" * 5000, headers=bad).status_code == 401
    assert client.post("/v1/nothing-here", json=CHAT).status_code == 401
    assert client.post("/v1/chat/completions", content=b'{"model": "m",', headers={**bad, **AUTH}).status_code == 400
    assert client.post("/v1/chat/completions", content=b"x" * 5000, headers={**bad, **AUTH}).status_code == 413
    assert client.get("/health").status_code == 503 and client.get("/metrics").status_code == 200  # (open)


def test_concurrent_metrics_scrapes_share_one_read_of_the_stages(client):
    """/metrics is open: each scrape read every stage's stats (32 clients in a loop doubled chat
    latency). Scrapes while a read is under way share it; a later one reads afresh."""
    import threading

    from omni_server.wire.messages import StageReady, StageStats

    orch = client.server_state.orch
    orch.ready[(0, 0)] = StageReady(stage_id=0, pid=1, startup_s=1.0)
    reads = []

    async def stats(stage_id, replica, timeout):
        reads.append((stage_id, replica))
        await asyncio.sleep(0.5)  # (the stage answering)
        return StageStats(stage_id=0, nonce=1, num_running=len(reads), num_waiting=0, request_ids=[], pid=1)

    orch.stats = stats
    texts = []
    scrapes = [threading.Thread(target=lambda: texts.append(client.get("/metrics").text)) for _ in range(5)]
    for t in scrapes:
        t.start()
    for t in scrapes:
        t.join()
    running = 'omni_stage_requests_running{model="m",replica="0",stage="thinker"}'
    assert reads == [(0, 0)] and all(f"{running} 1.0" in t for t in texts)
    assert f"{running} 2.0" in client.get("/metrics").text and reads == [(0, 0)] * 2


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
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "other"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"] | {"message": ""} == {
        "message": "", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}  # (as OpenAI's)


def test_a_body_that_is_not_json_names_no_parameter(client):
    r = client.post("/v1/chat/completions", content=b'{"model": "m",', headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None


def test_a_validators_message_reads_without_pydantics_prefix(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True}}, headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("stream_options: only"), r.json()


@pytest.mark.parametrize("path, body, where", [
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "hi \\ud83d"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\udc00 hi"}]}]}', "messages.0.content.0.text"),
    ("/v1/chat/completions", '{"model": "m\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("/v1/completions", '{"model": "m", "prompt": ["ok", "x\\ud83d"]}', "prompt.1"),
    ("/v1/audio/speech", '{"model": "m\\udfff", "input": "hi"}', "model"),
    ("/v1/responses", '{"model": "m", "input": "hi", "metadata": {"k": "\\ud83d"}}', "metadata.k"),
    ("/v1/responses", '{"model": "m", "input": "hi", "metadata": {"\\ud83d": "v"}}', "metadata (a key)"),
    ("/v1/responses", '{"model": "m", "input": "hi", "instructions": "\\ud83d"}', "instructions"),
])
def test_text_that_is_not_unicode_is_400_naming_where(client, path, body, where):
    """JSON's `\\ud83d` alone decodes to a lone UTF-16 surrogate, which is no Unicode text: the
    tokenizer raised on it and any reply echoing it (an unknown model's 404, the Responses API's
    metadata) could not be encoded: 500s. A 400 names where it is."""
    r = client.post(path, content=body.encode(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"{where}: holds a lone UTF-16 surrogate"), r.json()
    assert r.json()["error"]["param"] == where


def test_an_input_audio_format_not_taken_and_a_speed_not_finite_are_400(client):
    part = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "zzz"}}
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": [part]}]},
                    headers=AUTH)
    assert r.status_code == 400 and "input_audio.format: Input should be 'wav', 'mp3'" in r.json()["error"]["message"], r.text
    r = client.post("/v1/audio/speech", content=b'{"model": "m", "input": "hi", "speed": NaN}',
                    headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "finite number" in r.json()["error"]["message"], r.text


def test_a_surrogate_pair_is_text(client):
    """An escaped pair (JSON's way to write U+1F600) is one character: no 400 (503 here: no stages)."""
    body = '{"model": "m", "messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}'
    r = client.post("/v1/chat/completions", content=body.encode(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 503, r.text


def _nested_schema(objects: int) -> dict:
    schema = {"type": "string"}
    for _ in range(objects):
        schema = {"type": "object", "properties": {"n": schema}}
    return schema


def test_json_schemas_are_bounded_before_they_reach_the_grammar_compiler(tiny_models, tmp_path):
    """A schema nested deep (its grammar took the text stage's loop minutes to build) or over 64 KiB
    is a 400 at the api, in response_format and in tool parameters; one of 30 nested objects passes
    (here to the 503 of a pipeline not up yet, or the tiny template's refusal of tools)."""
    cfg = load_config_text((CONFIG % (MODELS / "tiny-qwen2_5-omni", tmp_path)).replace("4096", "1000000"))
    client = TestClient(create_app(ServerState(cfg, lambda: Orchestrator(cfg, tmp_path))))

    def chat(schema: dict, where: str):
        body = dict(CHAT)
        if where == "format":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        else:
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        return client.post("/v1/chat/completions", json=body, headers=AUTH)

    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}
    for where in ("format", "tools"):
        r = chat(_nested_schema(40), where)
        assert r.status_code == 400 and "nests deeper than 64 levels" in r.json()["error"]["message"], r.text
        r = chat(wide, where)
        assert r.status_code == 400 and "over 64 KiB" in r.json()["error"]["message"], r.text
        r = chat(_nested_schema(30), where)  # (past validation: 503, or for tools the tiny template's 400)
        assert r.status_code == 503 if where == "format" else "chat template" in r.json()["error"]["message"], r.text
        # Counted repeats unroll in the grammar ({1,50000}: the stage's loop held past its timeout).
        for pattern in ("[a-z]{1,50000}", "(ab{50}){50}"):
            r = chat({"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}, where)
            assert r.status_code == 400 and "repeat to over 1024 positions" in r.json()["error"]["message"], r.text
        r = chat({"type": "object", "patternProperties": {"^x{1100}$": {"type": "integer"}}}, where)
        assert r.status_code == 400 and "repeat to over 1024 positions" in r.json()["error"]["message"], r.text
        email = r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9.-]{1,255}\.[A-Za-z]{2,63}$"
        r = chat({"type": "object", "properties": {"e": {"type": "string", "pattern": email}}}, where)
        assert r.status_code == 503 if where == "format" else "chat template" in r.json()["error"]["message"], r.text


def test_a_chat_of_too_many_messages_or_parts_is_400_before_its_template_renders(tiny_models, tmp_path):
    cfg = load_config_text((CONFIG % (MODELS / "tiny-qwen2_5-omni", tmp_path)).replace("4096", "16000000"))
    client = TestClient(create_app(ServerState(cfg, lambda: Orchestrator(cfg, tmp_path))))
    many = {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 4097}
    r = client.post("/v1/chat/completions", json=many, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    parts = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 1025}]}
    r = client.post("/v1/chat/completions", json=parts, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content"), r.text
    fits = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 1024}] * 4}
    assert client.post("/v1/chat/completions", json=fits, headers=AUTH).status_code == 503  # (past validation)
    # Within each cap, but 8193 parts in all: counted before any is validated (640k held the loop ~4 s).
    many_parts = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 1024}] * 8
                  + [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    r = client.post("/v1/chat/completions", json=many_parts, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "8193 content parts and tool calls; the limit is 8192" in r.json()["error"]["message"]


def test_a_top_k_past_any_vocabulary_is_400(client):
    """(10**30 passed validation and failed to encode for the wire: a 500 and a logged traceback)"""
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": CHAT["model"], "prompt": "x"})):
        r = client.post(path, json={**body, "top_k": 10**30}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text


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
    # The limit counts every choice: n=2 needs 2 slots, and one is free.
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers=AUTH)
    assert r.status_code == 429, r.text
    assert "1 of its 2 concurrent request slots free, this request needs 2" in r.json()["error"]["message"]
    del orch.requests["busy-1"]
    assert client.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers=AUTH).status_code == 503


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


def test_choice_i_samples_with_seed_plus_i(tiny_models, tmp_path):
    """n > 1: every seeded stage of choice i draws from seed + i (choice 0 as an n = 1 request);
    unseeded stages stay unseeded, and nothing else changes."""
    from omni_server.api.app import _choice_sampling, _sampling
    from omni_server.api.protocol import ChatCompletionRequest

    m = MODELS / "tiny-qwen2_5-omni"
    cfg = load_config_text(SPEECH % (m, m, m, tmp_path))
    state = ServerState(cfg, lambda: Orchestrator(cfg, tmp_path))
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], seed=7, n=3)
    seeded = _sampling(state, body)
    assert _choice_sampling(seeded, 0) == seeded
    third = _choice_sampling(seeded, 2)
    assert {i: spec.seed for i, spec in third.items()} == {0: 9, 1: 9, 2: 9}
    assert third[1].temperature == 0.9 and third[1].top_k == 40
    assert {spec.seed for spec in seeded.values()} == {7}  # (copies: choice 0's untouched)
    unseeded = _sampling(state, body.model_copy(update={"seed": None}))
    assert {spec.seed for spec in _choice_sampling(unseeded, 2).values()} == {None}


def test_a_refused_choice_aborts_the_choices_already_submitted(tiny_models, tmp_path):
    """All or none: when the pipeline refuses choice 1, choice 0 (submitted) and 1 are aborted, and the
    request is the refusal's 503 (n=2: the limit here)."""
    from omni_server.api.app import _submit
    from omni_server.api.errors import APIError
    from omni_server.orchestrator.orchestrator import RequestState, StageUnavailable

    class Refuses:
        def __init__(self):
            self.requests, self.submitted, self.aborted = {}, [], []

        async def submit(self, request_id, *args):
            if self.submitted:
                raise StageUnavailable("stage 0 is down")
            self.submitted.append(request_id)
            return RequestState(request_id, {0})

        async def abort(self, request_id, outcome="aborted"):
            self.aborted.append(request_id)

        def in_flight(self):
            return 0

    cfg = load_config_text(CONFIG % (MODELS / "tiny-qwen2_5-omni", tmp_path))
    orch = Refuses()
    with pytest.raises(APIError) as err:
        asyncio.run(_submit(ServerState(cfg, lambda: orch), orch, ["c-0", "c-1"], [[1]] * 2, [{}] * 2, {"text"}, {}))
    # (c-1 too: the orchestrator registers a request before sending it, so a failed send leaves it.)
    assert err.value.status == 503 and orch.submitted == ["c-0"] and orch.aborted == ["c-0", "c-1"]


def test_choice_omni_outputs_only_when_set():
    """n = 1 choices read as before (no `omni_outputs` key); n > 1 ones carry their own."""
    from omni_server.api.protocol import Choice, ResponseMessage

    plain = Choice(message=ResponseMessage(content="x"), finish_reason="stop")
    assert "omni_outputs" not in plain.model_dump(mode="json") and "omni_outputs" not in plain.model_dump_json()
    own = plain.model_copy(update={"index": 1, "omni_outputs": {"talker": {"token_ids": [1, 2]}}})
    assert own.model_dump(mode="json")["omni_outputs"] == {"talker": {"token_ids": [1, 2]}}


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


HELLO = [1021]  # "Hello" (tiny checkpoint)


class _Deltas:
    """An orchestrator stand-in: each request's deltas come from its own queue (an error delta
    ends it, as the orchestrator does after dropping it everywhere); aborts are recorded."""

    def __init__(self):
        self.queues: dict[str, asyncio.Queue] = {}
        self.aborted: list[str] = []

    async def deltas(self, req):
        while not req.done:
            delta = await self.queues[req.request_id].get()
            req.done = delta.finished or delta.error is not None
            yield 0, delta

    async def abort(self, request_id, outcome="aborted"):
        self.aborted.append(request_id)


def _bounded(main):
    """`main()` on a fresh loop, failing rather than hanging past 30 s (in the same task)."""

    async def bounded():
        async with asyncio.timeout(30):
            return await main()

    return asyncio.run(bounded())


def _completion(tmp_path, n: int, orch: _Deltas, **body):
    """A chat completion of n choices over `orch`, as the chat route builds it."""
    from omni_server.api.runs import Completion, Run
    from omni_server.api.protocol import ChatCompletionRequest
    from omni_server.orchestrator.orchestrator import RequestState

    cfg = load_config_text(CONFIG % (MODELS / "tiny-qwen2_5-omni", tmp_path))
    state = ServerState(cfg, lambda: orch)
    request = ChatCompletionRequest(**CHAT, n=n, **body)
    runs = []
    for i in range(n):
        orch.queues[f"c-{i}"] = asyncio.Queue()
        runs.append(Run(state, orch, RequestState(f"c-{i}", {0}), request, [1, 2, 3], index=i))
    return Completion("c", runs)


def test_a_choice_failing_mid_stream_ends_the_stream_and_aborts_the_others(tiny_models, tmp_path):
    """The merged stream: each choice's chunks under its index; one choice's error is an error
    event, then [DONE], and the other choice is aborted."""
    from omni_server.wire.messages import RequestDelta

    async def main():
        orch = _Deltas()
        completion = _completion(tmp_path, 2, orch, stream=True)
        for i in range(2):
            orch.queues[f"c-{i}"].put_nowait(RequestDelta(f"c-{i}", new_token_ids=HELLO))
        stream = completion.sse(await completion.first())
        events = [await anext(stream) for _ in range(4)]  # two role chunks, two text chunks
        orch.queues["c-1"].put_nowait(RequestDelta("c-1", error="stage 0 died", error_code=503))
        events += [e async for e in stream]
        return orch, [json.loads(e[6:]) if e != "data: [DONE]\n\n" else "[DONE]" for e in events]

    orch, events = _bounded(main)
    chunks = [e["choices"][0] for e in events[:4]]
    assert sorted((c["index"], "role" in c["delta"]) for c in chunks) == [(0, False), (0, True), (1, False), (1, True)]
    assert events[4]["error"]["message"] == "stage 0 died" and events[5:] == ["[DONE]"]
    assert orch.aborted == ["c-0"]  # (c-1 was dropped by the orchestrator with its error)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_every_choice(tiny_models, tmp_path, stream):
    """Cancelled while gathering (a non-streamed request) or mid-stream: every request is aborted,
    once, and no task is left behind."""
    from omni_server.wire.messages import RequestDelta

    async def main():
        orch = _Deltas()
        completion = _completion(tmp_path, 3, orch, stream=stream)
        for i in range(3):
            orch.queues[f"c-{i}"].put_nowait(RequestDelta(f"c-{i}", new_token_ids=HELLO))
        if stream:
            sse = completion.sse(await completion.first())
            for _ in range(6):  # role and text chunks: every choice now waits for its next delta
                await anext(sse)
            await sse.aclose()  # (what the server does when the client goes)
        else:
            task = asyncio.ensure_future(completion.collect())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(0.05)
        return orch, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    orch, left = _bounded(main)
    assert sorted(orch.aborted) == ["c-0", "c-1", "c-2"] and left == []


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_gone_before_the_first_chunk_aborts_every_choice(tiny_models, tmp_path, spec):
    """The status line cannot be sent (the client left after the first outputs came): the stream's
    generator never starts, so its own clean-up never runs; the response still aborts every choice
    (ASGI 2.4 servers raise on the failed send, 2.3 ones report the disconnect)."""
    from starlette.requests import ClientDisconnect

    from omni_server.api.app import _AbortingStream
    from omni_server.wire.messages import RequestDelta

    async def main():
        orch = _Deltas()
        completion = _completion(tmp_path, 2, orch, stream=True)
        for i in range(2):
            orch.queues[f"c-{i}"].put_nowait(RequestDelta(f"c-{i}", new_token_ids=HELLO))
        response = _AbortingStream(completion.sse(await completion.first()), completion.abort)

        async def send(message):
            raise OSError("connection reset")

        async def receive():
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"spec_version": spec}}
        try:
            await response(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        return orch

    assert sorted(_bounded(main).aborted) == ["c-0", "c-1"]


def test_a_prompt_over_the_limit_is_400_naming_its_field(tiny_models, tmp_path):
    """Chat names `messages`, a completion `prompt` (checked before any stage is asked)."""
    cfg = load_config_text(CONFIG.replace("max_concurrent_requests: 2}", "max_concurrent_requests: 2, max_prompt_tokens: 3}")
                           % (MODELS / "tiny-qwen2_5-omni", tmp_path))
    with TestClient(create_app(ServerState(cfg, lambda: Orchestrator(cfg, tmp_path)))) as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        r = c.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3, 4]}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "4 tokens, the limit is 3" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "context_length_exceeded"  # (OpenAI's code for it)


def test_the_prompt_limit_is_the_context_length_the_engine_settled_on(tiny_models, tmp_path):
    """Stage 0's engine reports its context length when ready: the limit follows it, whatever the
    config says (-1 or "auto" for vLLM's choice, or nothing), capped by `server.max_prompt_tokens`."""
    from types import SimpleNamespace

    from omni_server.wire.messages import StageReady

    for engine_len, cap, limit in ((-1, None, 4095), ("auto", 100, 100), (None, None, 4095)):
        text = CONFIG.replace("output: text}", "output: text, engine_args: {max_model_len: %s}}" % (
            "null" if engine_len is None else engine_len))
        if cap:
            text = text.replace("max_concurrent_requests: 2}", f"max_concurrent_requests: 2, max_prompt_tokens: {cap}}}")
        cfg = load_config_text(text % (MODELS / "tiny-qwen2_5-omni", tmp_path))
        state = ServerState(cfg, lambda: None)
        assert state.prompt_limit == cap  # (no stage ready yet: the cap alone)
        ready = StageReady(stage_id=0, pid=1, startup_s=1.0, info={"max_model_len": "4096"})
        state.orch = SimpleNamespace(stage_info=lambda stage_id: ready if stage_id == 0 else None)
        assert state.prompt_limit == limit


def test_a_max_tokens_the_context_cannot_hold_is_400_naming_the_clients_field(client):
    """Stage 0's context (128 here) must hold the prompt and the max_tokens the client set (it was
    cut short instead, reported as if it reached max_tokens); the default is cut to fit. Each error
    names the field the client sent."""
    from omni_server.wire.messages import StageReady

    ready = StageReady(stage_id=0, pid=1, startup_s=1.0, info={"max_model_len": "128"})
    client.server_state.orch.stage_info = lambda stage_id: ready if stage_id == 0 else None
    post = lambda path, **kw: client.post(path, json=kw, headers=AUTH)  # noqa: E731
    for path, body, param in (
            ("/v1/chat/completions", {**CHAT, "max_tokens": 60}, "max_tokens"),
            ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 60}, "max_completion_tokens"),
            ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 60}, "max_output_tokens"),
            ("/v1/completions", {"model": "m", "prompt": [1] * 120}, "max_tokens")):  # (its default: 16)
        r = post(path, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        assert "this model's context is 128 tokens" in r.json()["error"]["message"]
    # Within the context, or no max_tokens: past this check (no pipeline here: 503).
    assert post("/v1/chat/completions", **CHAT).status_code == 503
    assert post("/v1/chat/completions", **CHAT, max_tokens=8).status_code == 503
    r = post("/v1/chat/completions", **CHAT, max_completion_tokens=99999)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    assert "max_completion_tokens 99999 exceeds the limit" in r.json()["error"]["message"]


def test_null_means_the_default_and_a_message_needs_content(client):
    post = lambda **kw: client.post("/v1/chat/completions", json=kw, headers=AUTH)  # noqa: E731
    assert post(**CHAT, n=None, stream=None, max_tokens=None).status_code == 503  # (valid; no pipeline here)
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": None, "echo": None, "stream": None},
                    headers=AUTH)
    assert r.status_code == 503, r.text
    for message in ({"role": "user"}, {"role": "user", "content": None}, {"role": "user", "content": []},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}):
        r = post(model="m", messages=[message])
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (message, r.text)


def test_merged_streams_lead_with_each_first_item_in_order_and_keep_finish_reason():
    """Choices' streams merged: every stream's first item (a choice's role chunk) in the streams'
    order, whichever is ready first (the openai client places choices by that order), then items as
    they come; stream chunks keep `finish_reason: null`, as OpenAI's (the legacy type requires it)."""
    from omni_server.api.protocol import ChatCompletionChunk, ChunkChoice, CompletionChoice, DeltaMessage
    from omni_server.api.runs import _merged

    async def stream(name: str, delays: list[float]):
        for k, d in enumerate(delays):
            await asyncio.sleep(d)
            yield f"{name}{k}"

    async def main():
        streams = [stream("a", [0.2, 0.0]), stream("b", [0.1, 0.3]), stream("c", [0.0, 0.0])]
        return [item async for item in _merged(streams)]

    items = asyncio.run(main())
    assert items[:3] == ["a0", "b0", "c0"] and sorted(items[3:]) == ["a1", "b1", "c1"] and items[-1] == "b1"
    chunk = ChatCompletionChunk(id="x", created=1, model="m", choices=[ChunkChoice(delta=DeltaMessage(content="hi"))])
    assert json.loads(chunk.model_dump_json(exclude_none=True))["choices"][0] == {
        "index": 0, "delta": {"content": "hi"}, "finish_reason": None}
    assert "finish_reason" in json.loads(CompletionChoice(index=0, text="t").model_dump_json(exclude_none=True))


def test_stage_stats_of_a_stage_with_no_ready_replica_is_a_503_at_once(tiny_models, tmp_path):
    """Not a 5 s wait for an answer that cannot come: the stage is down (or starting), and says so."""
    cfg = load_config_text(CONFIG % (MODELS / "tiny-qwen2_5-omni", tmp_path))
    with TestClient(create_app(ServerState(cfg, lambda: Orchestrator(cfg, tmp_path)))) as c:
        t0 = time.monotonic()
        r = c.get("/v1/omni/stages/0/stats", headers=AUTH)
        assert r.status_code == 503 and "is starting" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 2.0


def test_transcription_pieces_are_clips_the_model_hears_whole():
    """A file longer than the model's clip is cut into clips of at most that length that add up to
    it, the last at least 1 s; a file within the clip, or a model reading clips whole, is one."""
    import numpy as np

    from omni_server.api.transcription import pieces

    rate = 16000
    noise = np.random.default_rng(0).standard_normal(int(95.5 * rate)).astype(np.float32)
    for seconds in (30.0, 30.01, 31.0, 61.0, 95.5):
        wave = noise[:int(seconds * rate)]
        clips = pieces(wave, 30.0, rate)
        assert np.array_equal(np.concatenate(clips), wave)
        assert all(c.size <= 30 * rate for c in clips) and clips[-1].size >= (rate if len(clips) > 1 else 1)
        assert len(clips) == (1 if seconds <= 30 else 2 if seconds <= 60 else 4 if seconds > 90 else 3)
    assert len(pieces(noise, None, rate)) == 1


def test_a_raw_body_cut_mid_stream_ends_without_its_last_chunk_and_without_raising():
    """A raw audio body whose pipeline fails after the status line went out (`BodyCut`): the response
    returns without the final chunk, so the server closes the connection and the client sees the body
    incomplete; the request is aborted; nothing propagates (it was two ERROR tracebacks in the log)."""
    from omni_server.api.app import _AbortingStream
    from omni_server.api.runs import BodyCut

    aborted, sent = [], []

    async def body():
        yield b"\x00\x01"
        raise BodyCut

    async def abort():
        aborted.append(True)

    async def receive():
        await asyncio.sleep(60)  # (the client stays: no disconnect)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(_AbortingStream(body(), abort, "audio/pcm")(scope, receive, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"], sent
    assert sent[1]["body"] == b"\x00\x01" and sent[1]["more_body"] is True
    assert aborted == [True]
