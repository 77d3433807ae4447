"""A stage's real loop in this process, fed by a script on a thread (the probes tests run as
subprocesses: vLLM's engine keeps process-wide state), and the report they print."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


class ScriptedSockets:
    """Stands in for StageSockets: messages from a queue, the stage's outputs recorded."""

    replica = 0

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.finished: dict[str, dict] = {}  # request id -> its finishing delta's facts
        self.tokens: dict[str, int] = {}
        self.stats: list = []
        self.payloads: list = []  # StagePayloads sent downstream

    def recv_inputs(self, timeout_ms):
        try:
            yield self.inbox.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return
        while True:
            try:
                yield self.inbox.get_nowait()
            except queue.Empty:
                return

    def send_api(self, msg) -> None:
        with self.cond:
            for d in getattr(msg, "deltas", ()):
                self.tokens[d.request_id] = self.tokens.get(d.request_id, 0) + len(d.new_token_ids)
                if d.finished:
                    self.finished[d.request_id] = {"reason": d.finish_reason, "error": d.error,
                                                   "code": d.error_code, "tokens": self.tokens[d.request_id]}
            if hasattr(msg, "nonce"):
                self.stats.append(msg)
            self.cond.notify_all()

    def send_stage(self, stage_id, msg, replica: int = 0) -> None:
        with self.cond:
            if hasattr(msg, "output_token_ids"):
                self.payloads.append(msg)
            self.cond.notify_all()

    def wait(self, what, timeout=TIMEOUT_S):
        with self.cond:
            if not self.cond.wait_for(what, timeout):
                raise TimeoutError(what)



def drive(stage, io: ScriptedSockets, script: Callable[[], None], report: dict) -> None:
    """Run `script` beside the stage's loop until it returns, then stop the loop and print `report`
    (a script's exception goes into it as `script_error`)."""
    from omni_server.wire.messages import Shutdown

    def run() -> None:
        try:
            script()
        except Exception as e:  # (reported, then the loop is stopped all the same)
            report["script_error"] = repr(e)
        finally:
            io.inbox.put(Shutdown())

    threading.Thread(target=run, daemon=True).start()
    stage.run()
    print("REPORT " + json.dumps(report))


def probe_report(module: str, *args: str) -> dict:
    """`python -m MODULE ARGS`'s report (asserting it ran and its script raised nothing)."""
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    assert "script_error" not in report, (report, out.stderr[-3000:])
    return report
