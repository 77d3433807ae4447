"""Schema-driven fuzzing of the HTTP API (schemathesis over the server's own OpenAPI spec): whatever
the body, the answer is never a 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings


def _fuzz(base_url: str, paths, max_examples: int, allowed=lambda path, status: status < 500) -> set[str]:
    """Fuzz every operation under `paths` (a predicate on the path); return the paths seen."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [op for op in (r.ok() for r in schema.get_all_operations()) if paths(op.path)]
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(timeout=120)
            assert allowed(op.path, response.status_code), (
                case.method, case.path, case.body, response.text[:500])

        fuzz()
    return {op.path for op in operations}


def test_no_server_errors(text_server):
    seen = _fuzz(text_server.base_url, lambda path: True, 40,
                 lambda path, status: status < 500 or (path == "/health" and status == 503))
    assert seen >= {"/v1/chat/completions", "/v1/responses", "/v1/models", "/health"}


def test_no_server_errors_from_speech_routes(speech_server):
    """The speech pipeline's own routes, where requests reach the talker and the vocoder (and the
    transcription and translation routes, whose uploads reach the thinker)."""
    seen = _fuzz(speech_server.base_url, lambda path: path.startswith("/v1/audio/"), 25)
    assert seen == {"/v1/audio/speech", "/v1/audio/voices", "/v1/audio/transcriptions", "/v1/audio/translations"}
