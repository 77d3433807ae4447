"""Prometheus metrics of the pipeline's requests, served at GET /metrics (text format).

Request metrics are observed where every request passes (the orchestrator's delta stream); stage
gauges are read from the stages' stats when scraped (`stage_samples`).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: first packets of an interactive reply up to long speech.
_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        r, m = self.registry, {"model": model}
        self.requests = Counter("omni_requests", "Pipeline requests ended, by outcome (ok, error, invalid, aborted)",
                                ["model", "outcome"], registry=r)
        self.ttft = Histogram("omni_time_to_first_token_seconds", "Submit to the first text token",
                              ["model"], buckets=_BUCKETS, registry=r).labels(**m)
        self.ttfp = Histogram("omni_time_to_first_audio_seconds", "Submit to the first audio piece",
                              ["model"], buckets=_BUCKETS, registry=r).labels(**m)
        self.duration = Histogram("omni_request_duration_seconds", "Submit to the last output of requests that ended ok",
                                  ["model"], buckets=_BUCKETS, registry=r).labels(**m)
        self.audio = Counter("omni_audio_seconds", "Seconds of audio sent", ["model"], registry=r).labels(**m)
        self.in_flight = Gauge("omni_requests_in_flight", "Requests submitted and not ended (at the scrape)",
                               ["model"], registry=r).labels(**m)
        self.model = model
        labels = ["model", "stage", "replica"]
        self.stage_running = Gauge("omni_stage_requests_running", "Requests in a stage's engine", labels, registry=r)
        self.stage_waiting = Gauge("omni_stage_requests_waiting", "Requests a stage holds for input or room",
                                   labels, registry=r)
        self.stage_steps = Gauge("omni_stage_steps_total", "Steps a stage took", labels, registry=r)
        self.stage_step_s = Gauge("omni_stage_step_seconds_total", "Seconds a stage spent in steps", labels, registry=r)
        self.stage_payload = Gauge("omni_stage_payload_bytes_total", "Bytes of tensors a stage sent to stages",
                                   labels, registry=r)
        self.stage_pauses = Gauge("omni_stage_backpressure_pauses_total", "Times a stage paused a request for a "
                                  "slow consumer", labels, registry=r)
        # Their ratio (of rates) is the mean time from a request's start to the stage's first output.
        self.stage_firsts = Gauge("omni_stage_first_outputs_total", "Requests a stage sent a first output for",
                                  labels, registry=r)
        self.stage_first_s = Gauge("omni_stage_first_output_seconds_total", "Seconds from requests' start to "
                                   "the stage's first output for them, summed", labels, registry=r)
        self.stage_underruns = Gauge("omni_stage_audio_underruns_total", "Streamed audio pieces a stage sent after "
                                     "the listener's audio ran out (real-time playback from the first piece)",
                                     labels, registry=r)
        self.stage_underrun_s = Gauge("omni_stage_audio_underrun_seconds_total", "Seconds streamed listeners' "
                                      "audio was out before a stage's next piece, summed", labels, registry=r)
        self.stage_cached = Gauge("omni_stage_prefix_cached_tokens_total", "Prompt tokens a stage's prefix cache "
                                  "spared", labels, registry=r)
        self._stage_fields = {"num_running": self.stage_running, "num_waiting": self.stage_waiting,
                              "steps": self.stage_steps, "step_s": self.stage_step_s,
                              "payload_bytes": self.stage_payload, "backpressure_pauses": self.stage_pauses,
                              "first_outputs": self.stage_firsts, "first_output_s": self.stage_first_s,
                              "underruns": self.stage_underruns, "underrun_s": self.stage_underrun_s,
                              "cached_tokens": self.stage_cached}
        self.stage_up = Gauge("omni_stage_up", "1 when the stage replica answered the scrape's stats query",
                              labels, registry=r)

    def ended(self, t0: float, outcome: str) -> None:
        self.requests.labels(model=self.model, outcome=outcome).inc()
        if outcome == "ok":
            self.duration.observe(time.monotonic() - t0)

    def stage_sample(self, stage: str, replica: int, stats) -> None:
        """One replica's stats (a StageStats, or None when it did not answer)."""
        labels = dict(model=self.model, stage=stage, replica=str(replica))
        self.stage_up.labels(**labels).set(0 if stats is None else 1)
        if stats is None:  # (down: the requests it ran are gone with it; its totals stay as they were)
            self.stage_running.labels(**labels).set(0)
            self.stage_waiting.labels(**labels).set(0)
            return
        for field, gauge in self._stage_fields.items():
            gauge.labels(**labels).set(getattr(stats, field))

    def render(self) -> bytes:
        return generate_latest(self.registry)
