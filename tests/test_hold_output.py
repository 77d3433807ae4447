"""A request whose text the api reads for stop strings (SamplingSpec.hold_output) and that ends by
itself goes downstream only on the api's word: a stop string found after the stage ended still cuts
what the next stage reads (without it, the speech of a fast reply ran past its transcript). A stage
that can decode reads the stop strings itself (tests/test_e2e_speech.py); this is the way of one that
cannot."""

from tests.loop_script import ROOT, probe_report


def test_an_ended_request_waits_for_the_apis_word():
    r = probe_report("tests.hold_probe", str(ROOT / "configs" / "default.yaml"))
    assert r["held_before_word"] == [] and r["held_known"] is True  # ended, held, known to the api's probe
    # FinishRequest(keep=2): the tokens before the stop and the end of sequence in the stop's place, sent then
    assert r["held_after_word"] == [3]
    assert r["free"] == [6] and r["whole"] == [6]  # no hold: at its end; keep=-1: all
    assert r["gone"] == [] and r["gone_known"] is False  # aborted while held: never sent, forgotten
