"""Schema-driven fuzzing of the HTTP API (schemathesis over the server's own OpenAPI spec): whatever
the body, the answer is never a 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings


def test_no_server_errors(text_server):
    schema = schemathesis.openapi.from_url(f"{text_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/models", "/health"}
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(timeout=120)
            assert response.status_code < 500 or (op.path == "/health" and response.status_code == 503), (
                case.method, case.path, case.body, response.text[:500])

        fuzz()


def test_no_server_errors_from_speech_routes(speech_server):
    """The speech pipeline's own routes, where requests reach the talker and the vocoder."""
    schema = schemathesis.openapi.from_url(f"{speech_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    speech = [op for op in operations if op.path.startswith("/v1/audio/")]
    assert {op.path for op in speech} == {"/v1/audio/speech", "/v1/audio/voices"}
    for op in speech:

        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(timeout=120)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

        fuzz()
