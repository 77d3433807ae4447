"""Run one AR stage of a pipeline in this process on one prompt and save what it sends downstream.

    python -m tests.stage_probe CONFIG STAGE OUT_DIR --processor NAME --prompt-ids 1,2,3 [--max-tokens N]
        [--stream CHUNK] [--requests N] [--then-prompt-ids 1,2,4]

A sink stage reading STAGE through input processor NAME is added (never started), so STAGE captures
and forwards its hidden states as in a served pipeline (`--stream`: the sink streams its input in
chunks of CHUNK positions); every StagePayload it sends for the request is written to
OUT_DIR/probe.<n>.safetensors (tensors, with the token ids and the engine step that sent it, by
batch index, in the metadata). `--requests N`: N - 1 more requests with the same prompt run beside
it. Greedy, ignore_eos. `--then-prompt-ids`: once those are done, request `then` runs that prompt
(its prefix may hit the cache the first one filled) beside one that feeds no stage, then request
`cold` the same prompt under another cache salt (computed whole); OUT_DIR/cached.json holds each
request's prefix cache hit in tokens. `--kv-blocks N`: the stage's KV cache holds N blocks of 128
tokens (its context: N - 1 blocks);
OUT_DIR/sched.json: the most requests running at once and those ever preempted. `--prompt-embeds N`:
the probe's prompt is N random embedding rows without ids (the stage must take prompt embeddings: one with `inputs`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from safetensors.torch import save_file


class _Recorder:
    """Stands in for StageSockets: keeps what the stage sends."""

    replica = 0

    def __init__(self):
        self.payloads = []  # (engine step, payload)
        self.step = 0
        self.cached: dict[str, int] = {}  # request id -> prompt tokens its prefix cache hit spared

    def send_api(self, msg) -> None:
        for delta in getattr(msg, "deltas", ()):
            if delta.num_prompt_tokens:
                self.cached.setdefault(delta.request_id, delta.num_cached_tokens)

    def send_stage(self, stage_id, msg, replica: int = 0) -> None:
        self.payloads.append((self.step, msg))

    def recv_inputs(self, timeout_ms):
        return iter(())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("stage", type=int)
    p.add_argument("out", type=Path)
    p.add_argument("--processor", required=True)
    p.add_argument("--prompt-ids", required=True)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--stream", type=int, default=0, metavar="CHUNK")
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--then-prompt-ids", default="")
    p.add_argument("--kv-blocks", type=int, default=0, metavar="N", help="the stage's KV cache: N blocks of 128 tokens")
    p.add_argument("--prompt-embeds", type=int, default=0, metavar="N",
                   help="the probe's prompt: N seeded random embedding rows, no ids (others keep --prompt-ids)")
    a = p.parse_args()
    from omni_server.config import load_config
    from omni_server.config.schema import PipelineConfig

    cfg = load_config(a.config)
    stage = cfg.stage(a.stage)
    for k, v in {**stage.env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}.items():
        os.environ.setdefault(k, v)
    data = cfg.model_dump(exclude_none=True)
    sink = len(data["stages"])
    data["stages"].append({"id": sink, "name": "sink", "model": "unused", "inputs": [a.stage],
                           "input_processor": a.processor,
                           **({"input_mode": "stream", "stream_chunk": a.stream} if a.stream else {})})
    if a.kv_blocks:  # (blocks of 128 tokens on any device; the context what one less holds)
        data["stages"][a.stage]["engine_args"].update(
            num_gpu_blocks_override=a.kv_blocks, block_size=128, max_model_len=(a.kv_blocks - 1) * 128)
    cfg = PipelineConfig(**data)

    from omni_server.models import register_vllm_models
    from omni_server.stage.ar import ARStage
    from omni_server.wire.messages import AddRequest, SamplingSpec

    register_vllm_models()
    rec = _Recorder()
    engine = ARStage(cfg, a.stage, rec)
    # With async scheduling (CUDA) a call returns the batch scheduled by the call before: steps are
    # numbered by batch, so the chunk timing reads the same on both paths.
    rec.step = -1 if engine.vllm_config.scheduler_config.async_scheduling else 0
    ids = [int(t) for t in a.prompt_ids.split(",")]
    sampling = SamplingSpec(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(a.requests):
        if i == 0 and a.prompt_embeds:
            import torch

            size = engine.vllm_config.model_config.get_hidden_size()
            rows = torch.randn(a.prompt_embeds, size, generator=torch.Generator().manual_seed(0)).to(engine.dtype)
            engine._add("probe", {"type": "embeds", "prompt_embeds": rows}, sampling, [sink])
            continue
        engine._handle(AddRequest(request_id="probe" if i == 0 else f"other{i}", prompt_token_ids=ids,
                                  forward_to=[sink], sampling=sampling))

    sched = engine.core.scheduler
    most_running, preempted = 0, set()

    def run() -> None:
        nonlocal most_running
        while engine.has_work():
            engine.step()
            rec.step += 1
            most_running = max(most_running, len(sched.running))
            preempted.update(r.request_id for q in (sched.running, sched.waiting) for r in q if r.num_preemptions)

    run()
    if a.then_prompt_ids:
        then = [int(t) for t in a.then_prompt_ids.split(",")]
        # Beside `then`, a request that feeds nobody: its rows sit between the emitted ones.
        engine._add("plain", {"type": "token", "prompt_token_ids": ids[::-1][:20]}, sampling, [])
        engine._add("then", {"type": "token", "prompt_token_ids": then}, sampling, [sink])
        run()
        engine._add("cold", {"type": "token", "prompt_token_ids": then, "cache_salt": "cold"}, sampling, [sink])
        run()
        # Two new requests sharing a new prefix, added together: the second may hit the blocks the
        # first computes in the same step.
        for rid, tail in (("twin_a", [7]), ("twin_b", [8, 9])):
            engine._add(rid, {"type": "token", "prompt_token_ids": then[::-1] + tail, "cache_salt": "twins"},
                        sampling, [sink])
        run()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cached.json").write_text(json.dumps(rec.cached))
    (a.out / "sched.json").write_text(json.dumps({"most_running": most_running, "preempted": sorted(preempted)}))
    kv = engine.core.scheduler.kv_cache_config
    spec = kv.kv_cache_groups[0].kv_cache_spec
    layers = len(kv.kv_cache_groups[0].layer_names)
    (a.out / "kv.json").write_text(json.dumps({  # what the engine's KV budget bought
        "budget": engine.vllm_config.cache_config.kv_cache_memory_bytes, "tokens": kv.num_blocks * spec.block_size,
        "kv_bytes_per_token": layers * spec.page_size_bytes // spec.block_size,
        "row_bytes": engine.vllm_config.model_config.get_hidden_size() * engine.dtype.itemsize}))
    counts: dict[str, int] = {}
    for step, msg in [(step, m) for step, m in rec.payloads if not m.request_id.startswith("other")]:
        n = counts[msg.request_id] = counts.get(msg.request_id, -1) + 1
        meta = {"prompt_token_ids": ",".join(map(str, msg.prompt_token_ids)),
                "output_token_ids": ",".join(map(str, msg.output_token_ids)), "step": str(step),
                "final": str(msg.final)}
        save_file({k: v.contiguous() for k, v in msg.tensors.items()}, str(a.out / f"{msg.request_id}.{n}.safetensors"),
                  metadata=meta)
    engine.core.shutdown()


if __name__ == "__main__":
    main()
