"""Run the default pipeline's tiny thinker stage in this process, its real loop fed by a script, to
show where media prompts are prepared (see omni_server/stage/preparing.py); prints a JSON report.

    python -m tests.prepare_probe CONFIG

vLLM's input processing of a media prompt is held at a gate until the script opens it, so what the
loop does meanwhile is seen without timing: a running text request must finish while an image
request is held; an image request aborted while held, and one vLLM rejects after processing its image, must not
leave the processor's and the engine's multimodal caches out of step (a later request with the same
image must still run).
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

from tests.loop_script import TIMEOUT_S, ScriptedSockets, drive

def main() -> None:
    config = sys.argv[1]
    from omni_server.config import load_config

    cfg = load_config(config)
    for k, v in {**cfg.stage(0).env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}.items():
        os.environ.setdefault(k, v)
    from omni_server.models import register_vllm_models
    from omni_server.stage.ar import ARStage
    from omni_server.wire.messages import AbortRequest, AddRequest, SamplingSpec, StatsQuery

    register_vllm_models()
    io = ScriptedSockets()
    stage = ARStage(cfg, 0, io)
    hf = stage.vllm_config.model_config.hf_config
    hf = getattr(hf, "thinker_config", hf)
    gate, held, ran = threading.Event(), threading.Event(), threading.Event()
    gate.set()
    media_threads: list[str] = []
    process = stage.inputs.process_inputs

    def gated(request_id, prompt, *args, **kwargs):
        if "multi_modal_data" in prompt:
            media_threads.append(threading.current_thread().name)
            held.set()
            gate.wait()
        try:
            return process(request_id, prompt, *args, **kwargs)
        finally:
            ran.set()

    stage.inputs.process_inputs = gated
    text = [532, 10, 11, 12, 13]
    with_image = [532, hf.vision_start_token_id, hf.image_token_index, hf.vision_end_token_id, 14, 15]
    rng = np.random.default_rng(0)
    # (the last: 448x448, 256 tokens once expanded)
    pictures = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(56, 84, 3)] * 2 + [(448, 448, 3)]]
    report: dict = {}

    def add(rid, ids=text, picture=None, max_tokens=4):
        import torch

        tensors = {} if picture is None else {"image.0": torch.from_numpy(picture)}
        io.inbox.put(AddRequest(request_id=rid, prompt_token_ids=ids, tensors=tensors,
                                sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))

    def script():
        try:
            # 1. A running text request goes on to its end while an image request's preparation is
            # held; a text request arriving after the image one waits for it (arrival order).
            add("txt", text, max_tokens=48)
            io.wait(lambda: io.tokens.get("txt", 0) > 0)
            gate.clear()
            add("img", with_image, pictures[0])
            held.wait(TIMEOUT_S)
            add("after")
            io.wait(lambda: "txt" in io.finished)
            io.inbox.put(StatsQuery(nonce=1))
            io.wait(lambda: io.stats)
            report["txt"] = io.finished["txt"]
            report["done_while_held"] = sorted(r for r in ("img", "after") if r in io.finished)
            report["known_while_held"] = sorted(r for r in ("img", "after") if r in io.stats[0].request_ids)
            report["waiting_while_held"] = io.stats[0].num_waiting
            gate.set()
            io.wait(lambda: "img" in io.finished and "after" in io.finished)
            report["img"] = io.finished["img"]
            report["after"] = io.finished["after"]
            # 2. Aborted while held; its job runs on (the caches see it); the same image again after.
            held.clear(), ran.clear(), gate.clear()
            add("gone", with_image, pictures[1])
            held.wait(TIMEOUT_S)
            io.inbox.put(AbortRequest(request_ids=["gone"]))
            io.inbox.put(StatsQuery(nonce=2))
            io.wait(lambda: len(io.stats) == 2)
            report["gone_known_after_abort"] = "gone" in io.stats[1].request_ids
            gate.set()
            ran.wait(TIMEOUT_S)
            add("again", with_image, pictures[1])
            io.wait(lambda: "again" in io.finished)
            report["again"] = io.finished["again"]
            report["gone"] = io.finished.get("gone")
            # 3. Rejected by vLLM after its image was processed (too long only with the image's
            # tokens); the same image again after.
            add("long", with_image + [16] * (stage.vllm_config.model_config.max_model_len - 100), pictures[2])
            io.wait(lambda: "long" in io.finished)
            report["long"] = io.finished["long"]
            add("short", with_image, pictures[2])
            io.wait(lambda: "short" in io.finished)
            report["short"] = io.finished["short"]
            report["media_threads"] = sorted(set(media_threads))
        finally:
            gate.set()

    drive(stage, io, script, report)


if __name__ == "__main__":
    main()
