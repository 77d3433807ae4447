"""Decode throughput of an AR stage with hidden-state emission vs plain vLLM, same model, same run.

    python benchmarks/runner_overhead.py --model qwen2-7b --mode vllm --batch 1 32
    python benchmarks/runner_overhead.py --model qwen2-7b --mode omni --batch 1 32

`--model qwen2-7b` writes a Qwen2-7B-shaped config (dummy weights, no tokenizer) to a temp dir;
`--model talker-7b` one of the Qwen2.5-Omni-7B talker's decoder sizes (as a Qwen3, whose config
takes its head_dim of 128 at 896 hidden; Qwen2's derives head_dim from them); any checkpoint dir works too. `--sampling talker`
samples as the talker does (temperature, top-k, top-p, repetition penalty) instead of greedily
(`talker-omni`: drawn by omni-server's sampler, as a served talker does):
with a small model the sampler's per-step host work is a large share of a decode step. `omni` runs our stage loop (ARStage: EngineCore + OmniScheduler +
hidden-emitting runner) with every request forwarding its hidden states to a consumer, whose
payloads are encoded as for the wire and dropped; `vllm` runs vllm.LLM.generate. `--prefix-caching`
turns vLLM's prefix caching on for both (each timed run's prompts new to the cache): `omni` then also
keeps every row beside the KV cache (stage/prefix_rows.py), the cost a served thinker pays per step. Prints one JSON
line per batch size: decode tokens/s = batch * output_len / median wall time of `--repeats` whole
generates (after a warm-up one), with the range of the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def qwen2_7b_dir() -> str:
    from transformers import Qwen2Config

    d = tempfile.mkdtemp(prefix="qwen2-7b-shape-")
    Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                rope_theta=1e6, tie_word_embeddings=False, torch_dtype="bfloat16",
                architectures=["Qwen2ForCausalLM"]).save_pretrained(d)
    return d


def talker_7b_dir() -> str:
    from transformers import Qwen3Config

    d = tempfile.mkdtemp(prefix="talker-7b-shape-")
    Qwen3Config(vocab_size=8448, hidden_size=896, intermediate_size=18944, num_hidden_layers=24,
                num_attention_heads=12, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                rope_theta=1e6, tie_word_embeddings=False, torch_dtype="bfloat16",
                architectures=["Qwen3ForCausalLM"]).save_pretrained(d)
    return d


# The Qwen2.5-Omni talker's sampling (configs/qwen2_5_omni.yaml), or greedy. "talker": drawn by
# vLLM's sampler; "talker-omni": by omni-server's (omni_server/stage/sampling.py), as served.
TALKER = dict(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05)
SAMPLING = {"greedy": dict(temperature=0.0), "talker": TALKER, "talker-omni": TALKER}


def decode_bytes_per_step(model_dir: str, batch: int, context: int, dtype_bytes: int = 2) -> int:
    """HBM bytes one decode step must read: every weight but the input embedding (one row of it is
    gathered) plus the batch's KV cache at `context` tokens. Qwen2-style dense decoder."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir).get_text_config(decoder=True)  # an omni thinker: its LM
    h, i, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    qkv = h + 2 * kv * hd
    layer = h * qkv + qkv + h * h + 3 * h * i + 2 * h
    weights = c.num_hidden_layers * layer + h + c.vocab_size * h
    kv_bytes = batch * context * c.num_hidden_layers * 2 * kv * hd
    return (weights + kv_bytes) * dtype_bytes


def prompts(n: int, length: int, run: int = 0) -> list[list[int]]:
    """n prompts; another `run` gives others that share no prefix block with them (prefix caching on:
    each timed run computes its prompts)."""
    return [[(i * 7919 + j * 104729 + run * 31) % 1000 + 10 for j in range(length)] for i in range(n)]


def _rate(mode: str, bs: int, out_len: int, walls: list[float]) -> dict:
    """Median wall time of the measured runs (the first run of each batch size is a warm-up)."""
    dt = statistics.median(walls)
    return {"mode": mode, "batch": bs, "tok_s": bs * out_len / dt, "wall_s": dt, "runs": len(walls),
            "tok_s_min": bs * out_len / max(walls), "tok_s_max": bs * out_len / min(walls)}


def run_vllm(engine_args: dict, batches: list[int], in_len: int, out_len: int, repeats: int,
             sampling: str = "greedy") -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from omni_server.stage import sampling as omni_sampling

    params = SAMPLING[sampling]
    if sampling == "talker-omni":
        engine_args = {**engine_args, "logits_processors": [omni_sampling.LOGITS_PROCESSOR]}
        params, spec = omni_sampling.vllm_params(**params, seed=None)
        params = {**params, "extra_args": {omni_sampling.SPEC: spec}}
    llm = LLM(**engine_args)
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True, detokenize=False, **params)
    results = []
    for bs in batches:
        walls = []
        for rep in range(repeats + 1):
            ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(bs, in_len, rep)]
            t0 = time.perf_counter()
            llm.generate(ps, sp, use_tqdm=False)
            if rep:
                walls.append(time.perf_counter() - t0)
        results.append(_rate("vllm", bs, out_len, walls))
    return results


class _NullSockets:
    """Stands in for StageSockets: encodes like the wire does, sends nowhere."""

    replica = 0

    def __init__(self):
        from omni_server.wire.codec import Encoder

        self.encoder = Encoder()
        self.payload_bytes = 0

    def send_api(self, msg) -> None:
        self.encoder.encode(msg)

    def send_stage(self, stage_id, msg, replica: int = 0) -> None:
        frames = self.encoder.encode(msg)
        self.payload_bytes += sum(len(memoryview(f).cast("B")) for f in frames)

    def recv_inputs(self, timeout_ms):
        return iter(())


def run_omni(engine_args: dict, batches: list[int], in_len: int, out_len: int, emit: bool,
             repeats: int, sampling: str = "greedy") -> list[dict]:
    from omni_server.config.schema import PipelineConfig
    from omni_server.stage.ar import ARStage
    from omni_server.stage.profiling import StepProfiler
    from omni_server.wire.messages import AddRequest, SamplingSpec

    args = {k: v for k, v in engine_args.items() if k != "model"}
    stages = [{"id": 0, "name": "s0", "model": engine_args["model"], "engine_args": args, "output": "tokens",
               "sampler": "omni" if sampling == "talker-omni" else "vllm"}]
    if emit:
        stages.append({"id": 1, "name": "sink", "model": "unused", "inputs": [0],
                       "input_processor": "hidden_to_embeds"})
    cfg = PipelineConfig(model="bench", stages=stages)
    sockets = _NullSockets()
    stage = ARStage(cfg, 0, sockets)
    spec = SamplingSpec(max_tokens=out_len, ignore_eos=True, **SAMPLING[sampling])
    fwd = [1] if emit else []
    prof = StepProfiler.from_env("runner")  # OMNI_PROFILE, as in a stage's loop
    results = []
    for bs in batches:
        walls = []
        for rep in range(repeats + 1):
            ps = prompts(bs, in_len, rep)
            t0 = time.perf_counter()
            for i, p in enumerate(ps):
                stage._handle(AddRequest(request_id=f"r{bs}-{rep}-{i}", prompt_token_ids=p, sampling=spec,
                                         forward_to=fwd))
            while stage.core.scheduler.has_requests():
                if prof is not None:
                    prof.before(stage.counts()[0])
                stage.step()
                if prof is not None:
                    prof.after()
            if rep:
                walls.append(time.perf_counter() - t0)
        results.append({**_rate("omni-emit" if emit else "omni-plain", bs, out_len, walls),
                        "payload_mb": round(sockets.payload_bytes / 2**20, 1)})
    if prof is not None:
        prof.finish()
    stage.core.shutdown()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2-7b")
    p.add_argument("--mode", choices=["vllm", "omni", "omni-plain"], required=True)
    p.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per batch size (median), after a warm-up")
    p.add_argument("--attention-splits", type=int, default=None,
                   help="FlashAttention's most KV splits in decode CUDA graphs (vLLM's default 32)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="vLLM's prefix caching on (for `omni`: with the hidden rows kept beside the KV cache)")
    a = p.parse_args()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    shapes = {"qwen2-7b": qwen2_7b_dir, "talker-7b": talker_7b_dir}
    model = shapes[a.model]() if a.model in shapes else a.model
    engine_args = dict(model=model, dtype=a.dtype, load_format="dummy", skip_tokenizer_init=a.model in shapes,
                       max_model_len=a.input_len + a.output_len + 64, max_num_seqs=max(a.batch),
                       gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
                       enable_prefix_caching=a.prefix_caching)
    if a.attention_splits is not None:
        engine_args["attention_config"] = {"flash_attn_max_num_splits_for_cuda_graph": a.attention_splits}
    if a.mode == "vllm":
        res = run_vllm(engine_args, a.batch, a.input_len, a.output_len, a.repeats, a.sampling)
    else:
        res = run_omni(engine_args, a.batch, a.input_len, a.output_len, emit=a.mode == "omni", repeats=a.repeats,
                       sampling=a.sampling)
    for r in res:
        # Achieved HBM read bandwidth of the decode steps (prefill's share of the wall time ignored).
        step = decode_bytes_per_step(model, r["batch"], a.input_len + a.output_len // 2)
        r["hbm_tb_s"] = round(r["tok_s"] / r["batch"] * step / 1e12, 3)
        print("RESULT " + json.dumps({"model": a.model, "sampling": a.sampling, "prefix_caching": a.prefix_caching,
                                      **r}), flush=True)


if __name__ == "__main__":
    main()
