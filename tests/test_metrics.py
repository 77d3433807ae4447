"""GET /metrics: Prometheus text with request outcomes, first-token / first-audio times and stage gauges."""

from __future__ import annotations

import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


def _scrape(server) -> dict[tuple[str, tuple], float]:
    resp = httpx.get(f"{server.base_url}/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def _get(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_a_speech_request(speech_server):
    before = _scrape(speech_server)
    client = openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="unused")
    resp = client.chat.completions.create(
        model="omni-tiny", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, seed=3,
        modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"})
    assert resp.choices[0].message.audio.data
    after = _scrape(speech_server)
    m = {"model": "omni-tiny"}
    assert _get(after, "omni_requests_total", outcome="ok", **m) == _get(before, "omni_requests_total", outcome="ok", **m) + 1
    for hist in ("omni_time_to_first_token_seconds", "omni_time_to_first_audio_seconds", "omni_request_duration_seconds"):
        assert _get(after, f"{hist}_count", **m) == _get(before, f"{hist}_count", **m) + 1
    first_token = _get(after, "omni_time_to_first_token_seconds_sum", **m) - _get(before, "omni_time_to_first_token_seconds_sum", **m)
    first_audio = _get(after, "omni_time_to_first_audio_seconds_sum", **m) - _get(before, "omni_time_to_first_audio_seconds_sum", **m)
    assert 0 < first_token <= first_audio
    assert _get(after, "omni_audio_seconds_total", **m) > _get(before, "omni_audio_seconds_total", **m)
    assert _get(after, "omni_requests_in_flight", **m) == 0
    for stage in ("thinker", "talker", "token2wav"):
        labels = dict(stage=stage, replica="0", **m)
        assert _get(after, "omni_stage_up", **labels) == 1
        assert _get(after, "omni_stage_steps_total", **labels) > _get(before, "omni_stage_steps_total", **labels)
        firsts = "omni_stage_first_outputs_total"
        assert _get(after, firsts, **labels) > _get(before, firsts, **labels)
        assert _get(after, "omni_stage_first_output_seconds_total", **labels) > 0
    assert _get(after, "omni_stage_payload_bytes_total", stage="thinker", replica="0", **m) > 0
    # The audio stage's own view of playback: pieces that came after the listener ran dry (a count, maybe 0).
    t2w = tuple(sorted(dict(stage="token2wav", replica="0", **m).items()))
    assert after[("omni_stage_audio_underruns_total", t2w)] >= 0
    assert after[("omni_stage_audio_underrun_seconds_total", t2w)] >= 0


def test_metrics_outcomes_of_a_stop_string_and_a_client_that_leaves(speech_server):
    client = openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="unused")
    kwargs = dict(model="omni-tiny", messages=[{"role": "user", "content": "Tell me about rivers."}], max_tokens=16,
                  temperature=0, modalities=["text"], extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    m = {"model": "omni-tiny"}
    before = _scrape(speech_server)
    # Text only and the stop string comes: the request ends early, by design.
    assert client.chat.completions.create(**kwargs, stop=[full[2:4]]).choices[0].finish_reason == "stop"
    mid = _scrape(speech_server)
    assert _get(mid, "omni_requests_total", outcome="ok", **m) == _get(before, "omni_requests_total", outcome="ok", **m) + 1
    assert _get(mid, "omni_requests_total", outcome="aborted", **m) == _get(before, "omni_requests_total", outcome="aborted", **m)
    # A streaming client that reads one chunk and goes away.
    body = {"model": "omni-tiny", "messages": kwargs["messages"], "max_tokens": 200, "stream": True,
            "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"}, "ignore_eos": True}
    with httpx.stream("POST", f"{speech_server.base_url}/v1/chat/completions", json=body, timeout=60) as resp:
        next(resp.iter_lines())
    deadline = time.monotonic() + 30
    while _get(_scrape(speech_server), "omni_requests_total", outcome="aborted", **m) == \
            _get(mid, "omni_requests_total", outcome="aborted", **m):
        assert time.monotonic() < deadline, "the abandoned request was never counted as aborted"
        time.sleep(0.5)
    assert _get(_scrape(speech_server), "omni_requests_in_flight", **m) == 0


def test_a_replica_that_stops_answering_holds_no_requests_in_the_gauges():
    """Its requests died with it: running / waiting drop to 0 (sums over replicas stay true); its
    totals stay as they were."""
    from types import SimpleNamespace

    from omni_server.orchestrator.metrics import Metrics

    metrics = Metrics("m")
    stats = SimpleNamespace(num_running=3, num_waiting=2, steps=10, step_s=1.5, payload_bytes=7, backpressure_pauses=0,
                            first_outputs=4, first_output_s=0.4, underruns=0, underrun_s=0.0, cached_tokens=0)
    labels = dict(model="m", stage="thinker", replica="1")

    def scrape():
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}

    metrics.stage_sample("thinker", 1, stats)
    assert _get(scrape(), "omni_stage_requests_running", **labels) == 3
    metrics.stage_sample("thinker", 1, None)
    after = scrape()
    assert _get(after, "omni_stage_up", **labels) == 0
    assert _get(after, "omni_stage_requests_running", **labels) == 0 == _get(after, "omni_stage_requests_waiting", **labels)
    assert _get(after, "omni_stage_steps_total", **labels) == 10
