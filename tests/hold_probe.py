"""Run the default pipeline's tiny thinker stage in this process, its real loop fed by a script, with
a sink stage after it, to show that a request with SamplingSpec.hold_output that ends by itself sends
its output downstream only on the api's FinishRequest; prints a JSON report.

    python -m tests.hold_probe CONFIG
"""

from __future__ import annotations

import os
import sys
import time

from tests.loop_script import ScriptedSockets, drive


def main() -> None:
    from omni_server.config import load_config
    from omni_server.config.schema import PipelineConfig

    cfg = load_config(sys.argv[1])
    for k, v in {**cfg.stage(0).env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}.items():
        os.environ.setdefault(k, v)
    data = cfg.model_dump(exclude_none=True)
    data["stages"] = [data["stages"][0], {"id": 1, "name": "sink", "model": "unused", "inputs": [0],
                                          "input_processor": "testing.record_hidden_to_embeds"}]
    cfg = PipelineConfig(**data)
    from omni_server.models import register_vllm_models
    from omni_server.stage.ar import ARStage
    from omni_server.wire.messages import AbortRequest, AddRequest, FinishRequest, SamplingSpec, StatsQuery

    register_vllm_models()
    io = ScriptedSockets()
    stage = ARStage(cfg, 0, io)
    report: dict = {}

    def add(rid, hold):
        io.inbox.put(AddRequest(request_id=rid, prompt_token_ids=[532, 10, 11, 12], forward_to=[1], sampling=SamplingSpec(
            max_tokens=6, temperature=0.0, ignore_eos=True, hold_output=hold)))

    def sent(rid):
        return [len(p.output_token_ids) for p in io.payloads if p.request_id == rid]

    def script():
        add("held", True)
        io.wait(lambda: "held" in io.finished)
        time.sleep(0.5)  # (the loop runs on: nothing may go out meanwhile)
        io.inbox.put(StatsQuery(nonce=1))
        io.wait(lambda: io.stats)
        report["held_before_word"] = sent("held")
        report["held_known"] = "held" in io.stats[0].request_ids
        io.inbox.put(FinishRequest(request_id="held", keep=2))
        io.wait(lambda: sent("held"))
        report["held_after_word"] = sent("held")
        add("free", False)
        io.wait(lambda: sent("free"))
        report["free"] = sent("free")
        add("whole", True)
        io.wait(lambda: "whole" in io.finished)
        io.inbox.put(FinishRequest(request_id="whole", keep=-1))
        io.wait(lambda: sent("whole"))
        report["whole"] = sent("whole")
        add("gone", True)
        io.wait(lambda: "gone" in io.finished)
        io.inbox.put(AbortRequest(request_ids=["gone"]))
        io.inbox.put(FinishRequest(request_id="gone", keep=-1))
        io.inbox.put(StatsQuery(nonce=2))
        io.wait(lambda: len(io.stats) == 2)
        time.sleep(0.3)
        report["gone"] = sent("gone")
        report["gone_known"] = "gone" in io.stats[1].request_ids

    drive(stage, io, script, report)


if __name__ == "__main__":
    main()
