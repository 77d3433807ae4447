"""Media prompts are prepared off the AR stage's loop (omni_server/stage/preparing.py)."""

import threading
import time

from omni_server.stage.preparing import Preparer
from tests.loop_script import ROOT, probe_report

CONFIG = ROOT / "configs" / "default.yaml"


def test_jobs_come_back_in_arrival_order_and_a_cancelled_one_never():
    p = Preparer()
    first_may_end = threading.Event()
    p.submit("a", lambda: first_may_end.wait(10) and "a")
    p.submit("b", lambda: "b")
    p.submit("c", lambda: "c")
    p.cancel("b")
    assert "b" not in p and "a" in p and p.ids() == {"a", "c"}
    assert p.done() == []  # (c may be done: it waits behind a)
    first_may_end.set()
    got = []
    while len(p):
        got += [(rid, job.result()) for rid, job in p.done()]
    assert got == [("a", "a"), ("c", "c")]
    p.close()


def test_a_job_dropped_while_running_keeps_the_worker_busy_until_it_ends():
    """(The loop thread must not run vLLM's input processing beside the worker.)"""
    p = Preparer()
    started, may_end = threading.Event(), threading.Event()
    p.submit("a", lambda: started.set() or may_end.wait(10))
    assert p.idle() is False and started.wait(10)
    p.cancel("a")
    assert len(p) == 0 and "a" not in p and p.idle() is False
    may_end.set()
    deadline = time.monotonic() + 10
    while not p.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.idle() and p.done() == []
    p.close()


def test_stage_keeps_stepping_while_an_image_is_prepared():
    r = probe_report("tests.prepare_probe", str(CONFIG))
    # A running text request went on to its end while the image request's processing was held; a
    # text request sent after the image one waited for it. Both were known (the api's probe must not
    # take them for lost) and counted as waiting.
    assert r["txt"]["reason"] == "length" and r["txt"]["error"] is None and r["txt"]["tokens"] == 48
    assert r["done_while_held"] == []
    assert r["known_while_held"] == ["after", "img"] and r["waiting_while_held"] == 2
    assert r["img"]["reason"] == "length" and r["img"]["tokens"] == 4
    assert r["after"]["reason"] == "length" and r["after"]["tokens"] == 4
    assert r["media_threads"] == ["prepare_0"]
    # Aborted while held: forgotten at once, never answered; its image in a later request runs.
    assert r["gone_known_after_abort"] is False and r["gone"] is None
    assert r["again"]["reason"] == "length" and r["again"]["tokens"] == 4, r["again"]
    # Too long with its image's tokens: a 400 after the image was processed; the same image in a
    # later request runs.
    assert r["long"]["code"] == 400 and "longer than the maximum model length of 2048" in r["long"]["error"], r["long"]
    assert r["short"]["reason"] == "length" and r["short"]["tokens"] == 4, r["short"]
