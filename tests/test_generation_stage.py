"""GenerationStage's per-request failures: whose fault an invalid input is decides the status."""

from __future__ import annotations

from types import SimpleNamespace

from omni_server.stage.generation import GenerationStage


def _failures(inputs: list[int], error: ValueError | None = None) -> list[tuple[str, str, int]]:
    calls: list[tuple[str, str, int]] = []
    fake = SimpleNamespace(streams={"r": object()}, stage=SimpleNamespace(name="vocoder", inputs=inputs), stage_id=2,
                           fail=lambda rid, msg, code=500: calls.append((rid, msg, code)),
                           sockets=SimpleNamespace(send_api=lambda msg: calls.append(("sent", "", 0))))
    error = error or ValueError("codec ids must lie in [0, 8193]")
    GenerationStage._send(fake, ["r"], [error], [True], [0])
    assert fake.streams == {}
    return calls


def test_input_from_an_upstream_stage_that_the_generator_rejects_is_a_server_error(caplog):
    """The server's fault: a 500 whose message names the stage and the exception's type, not its
    text (internals); the text goes to the server log."""
    with caplog.at_level("WARNING"):
        calls = _failures([1])
    assert calls == [("r", "stage vocoder: rejected its input from upstream (ValueError; the server log has the "
                           "details)", 500)]
    assert "codec ids must lie in [0, 8193]" in caplog.text


def test_input_straight_from_the_request_that_the_generator_rejects_is_a_client_error():
    assert _failures([]) == [("r", "stage vocoder: codec ids must lie in [0, 8193]", 400)]


def test_the_requests_own_bad_option_is_a_client_error_also_from_upstream(tmp_path):
    """An unknown voice (the request's option, RequestError) is the client's fault in any stage,
    also in full mode, where token2wav finds it inside its batch (as in stream mode, at open)."""
    from omni_server.models.qwen2_5_omni.token2wav import Token2Wav
    from omni_server.stage.generators import RequestError
    from tests.conftest import MODELS

    assert _failures([1], RequestError("unknown voice 'Nobody'")) == [("r", "stage vocoder: unknown voice 'Nobody'",
                                                                         400)]
    t2w = Token2Wav(str(MODELS / "tiny-qwen2_5-omni"))
    [err] = t2w.batch([{"codes": [1, 2, 3], "voice": "Nobody", "seed": 0}])
    assert isinstance(err, RequestError) and "unknown voice 'Nobody'" in str(err)
    try:
        t2w.open_stream("Nobody")
    except RequestError as e:
        assert "unknown voice" in str(e)
    else:
        raise AssertionError("open_stream took an unknown voice")


def test_playback_counts_audio_at_the_listeners_speed():
    """/v1/audio/speech's `speed` 4: the api stretches each second of audio to a quarter, so the
    stage's playback model (underruns, stream order) counts it as 0.25 s: 1 s sent at t, 1 s more
    at t + 0.6 ran dry 0.35 s before it (at speed 1: not at all)."""
    import torch

    from omni_server.stage import stream_order

    def dry_after_two_pieces(speeds: dict) -> float:
        fake = SimpleNamespace(streams={}, stage=SimpleNamespace(name="vocoder", inputs=[1]), speeds=speeds,
                               playback=stream_order.Playback(), underruns=0, underrun_s=0.0,
                               generator=SimpleNamespace(sample_rate=1000), send_outputs=lambda deltas: None)
        fake.playback.open("r", 0.0)
        GenerationStage._send(fake, ["r"], [torch.zeros(1000)], [False], [0])
        fake.playback._first["r"] -= 0.6  # (the first piece went out 0.6 s ago)
        GenerationStage._send(fake, ["r"], [torch.zeros(1000)], [False], [0])
        return fake.underrun_s

    assert dry_after_two_pieces({}) == 0.0
    assert abs(dry_after_two_pieces({"r": 4.0}) - 0.35) < 0.01


def test_an_input_processor_error_is_the_clients_only_when_it_is_the_requests_own():
    """A RequestError (an unknown voice) is a 400; any other error of an input processor is the
    server's (its stages disagree about a payload): a 500, not an invalid_request_error."""
    from omni_server.stage.base import Stage, _Waiting
    from omni_server.stage.errors import RequestError
    from omni_server.wire.messages import ExpectRequest, SamplingSpec, StagePayload

    def failure(error: Exception) -> tuple[str, int]:
        calls = []

        def processor(payloads, ctx, options):
            raise error

        w = _Waiting(expect=ExpectRequest(request_id="r", sampling=SamplingSpec(), sources=[0]))
        w.payloads[0] = StagePayload(request_id="r", source_stage=0, prompt_token_ids=[1], output_token_ids=[2],
                                     final=True)
        fake = SimpleNamespace(waiting={"r": w}, stage=SimpleNamespace(name="talker", input_mode="full"),
                               stage_id=1, processor=processor,
                               fail=lambda rid, msg, code=500: calls.append((msg, code)))
        assert Stage._build(fake, "r") is None
        [call] = calls
        return call

    assert failure(RequestError("unknown voice 'Nobody'")) == ("stage talker: unknown voice 'Nobody'", 400)
    from omni_server.models.qwen2_5_omni.processors import _voice

    try:
        _voice({"voice": "Nobody"}, {"Chelsie", "Ethan"})
    except RequestError as e:
        assert "unknown voice 'Nobody'" in str(e)
    else:
        raise AssertionError("the talker's processor took an unknown voice")
    msg, code = failure(ValueError("thinker payload has hidden states (3, 8) for 2 prompt + 2 output tokens"))
    assert (msg, code) == ("stage talker: input processing failed (ValueError; the server log has the details)", 500)


def test_a_native_librarys_source_path_stays_out_of_a_400():
    """xgrammar's C++ errors start with a time and its build's source path; the client reads the rest."""
    import xgrammar

    from omni_server.stage.errors import client_text

    try:
        xgrammar.Grammar.from_json_schema('{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}')
    except RuntimeError as e:
        assert ".cc:" in str(e)
        assert client_text(e) == "Cannot find field 'nope' in #/nope"
    else:
        raise AssertionError("xgrammar took a reference to nothing")
    assert client_text(ValueError("prompt of 9000 tokens\n exceeds 8192")) == "prompt of 9000 tokens exceeds 8192"
