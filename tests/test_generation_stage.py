"""GenerationStage's per-request failures: whose fault an invalid input is decides the status."""

from __future__ import annotations

from types import SimpleNamespace

from omni_server.stage.generation import GenerationStage


def _failures(inputs: list[int]) -> list[tuple[str, str, int]]:
    calls: list[tuple[str, str, int]] = []
    fake = SimpleNamespace(streams={"r": object()}, stage=SimpleNamespace(name="vocoder", inputs=inputs),
                           fail=lambda rid, msg, code=500: calls.append((rid, msg, code)),
                           sockets=SimpleNamespace(send_api=lambda msg: calls.append(("sent", "", 0))))
    GenerationStage._send(fake, ["r"], [ValueError("codec ids must lie in [0, 8193]")], [True], [0])
    assert fake.streams == {}
    return calls


def test_input_from_an_upstream_stage_that_the_generator_rejects_is_a_server_error():
    assert _failures([1]) == [("r", "stage vocoder: rejected its input from upstream: codec ids must lie in [0, 8193]",
                               500)]


def test_input_straight_from_the_request_that_the_generator_rejects_is_a_client_error():
    assert _failures([]) == [("r", "stage vocoder: codec ids must lie in [0, 8193]", 400)]
