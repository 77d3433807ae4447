"""Collect one device run's outputs into the issue-5 result keys: `python benchmarks/collect.py DIR
--out benchmarks/results/NAME.json`. DIR holds what benchmarks/gpu/session.sh wrote (bench JSON,
serve logs, runner_overhead.py's RESULT lines in runner_*.txt); a key whose input is missing is
null, so runs can be compared key by key."""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def _level(path: Path) -> dict | None:
    if not path.exists():
        return None
    (level,) = json.loads(path.read_text())["levels"][:1]
    # A level where requests failed measured something else (the survivors only): no numbers from it.
    return None if level.get("errors") else level


def _get(d: dict | None, *keys):
    for k in keys:
        if d is None:
            return None
        d = d.get(k)
    return d


H200_HBM_TB_S = 4.3


TINY = "tiny-qwen2_5-omni"


def _results(files) -> list[dict]:
    """The `RESULT {json}` lines the benchmark scripts print, from these files in order."""
    return [json.loads(line[7:]) for f in files if f.exists()
            for line in f.read_text().splitlines() if line.startswith("RESULT ")]


def _runner(out: Path, batch: int, model: str = "qwen2-7b", variant: str = "") -> dict[str, dict]:
    """runner_overhead RESULT lines at this batch for this model (its name or its dir's), by mode;
    `variant`: a session step's own runs (runner_<variant>_*.txt, e.g. `splits`)."""
    # (Not runner_prof*: the profiled run's steps are slowed by the profiler; nor a variant's.)
    files = sorted(out.glob(f"runner_{variant}_*.txt")) if variant else \
        [f for f in sorted(out.glob("runner_*.txt")) if not f.name.startswith(("runner_prof", "runner_splits", "runner_pc"))]
    return {r.get("mode", ""): r for r in _results(files)
            if r.get("batch") == batch and Path(str(r.get("model", ""))).name == model}


def _runner_ratio(out: Path, batch: int, model: str = "qwen2-7b", mode: str = "omni-emit",
                  variant: str = "") -> float | None:
    """Our stage loop's tok/s (with emission, or `omni-plain` without) / vllm tok/s at this batch."""
    rows = _runner(out, batch, model, variant)
    ours, plain = _get(rows, mode, "tok_s"), _get(rows, "vllm", "tok_s")
    return round(ours / plain, 3) if ours and plain else None


def _hbm_fraction(out: Path, variant: str = "", mode: str = "omni-emit") -> float | None:
    """A batch-1 decode's bytes/s (weights + KV per step) / the H200's 4.3 TB/s: the emitting
    stage's, or plain vLLM's (`mode` vllm)."""
    tb_s = _get(_runner(out, 1, variant=variant), mode, "hbm_tb_s")
    return round(tb_s / H200_HBM_TB_S, 3) if tb_s else None


def _talker(out: Path) -> dict:
    """Session step `talker` (talker_*.txt): decode tok/s of the 7B talker's shape per engine (plain
    vLLM, our stage loop), sampling (greedy, the talker's) and batch."""
    # (Not talker_prof_*: one profiled repeat, slowed by the profiler.)
    files = [f for f in sorted(out.glob("talker_*.txt")) if not f.name.startswith("talker_prof")]
    return {f"talker_{r['mode']}_{r['sampling']}_bs{r['batch']}_tok_s": round(r["tok_s"], 1)
            for r in _results(files)}


def _ready_s(log: Path) -> float | None:
    m = re.search(r"all \d+ stages ready in ([\d.]+) s", log.read_text(errors="replace")) if log.exists() else None
    return float(m.group(1)) if m else None


def _token2wav_speed(out: Path) -> dict:
    """benchmarks/token2wav_speed.py RESULT lines (t2w.txt): per mode and batch, ms per window step
    and RTF, and per mode its start (construction, warm-up and any compile) in seconds."""
    # Several steps write the same mode and batch (t2w, qkv, pastkv, pastkvab into t2w.txt): a
    # timing key is the median of its runs; a start time the first's (a later mode in the same
    # process does not start cold).
    runs: dict[str, list] = {}
    starts: dict = {}
    for r in _results([out / "t2w.txt"]):
        name = f"t2w_{r['mode']}"
        runs.setdefault(f"{name}_b{r['batch']}_step_ms", []).append(r.get("step_ms_p50"))
        runs.setdefault(f"{name}_b{r['batch']}_rtf", []).append(r.get("rtf"))
        if r.get("start_s") is not None:
            starts.setdefault(f"{name}_start_s", r["start_s"])
    # steps t2wprof, t2wtriton: t2wprof_<mode>_w<last window>_b<batch>_{step_ms,rtf,dit_s,vocoder_s}
    for r in _results([out / "t2wprof.txt", out / "t2wtriton.txt"]):
        name = f"t2wprof_{r['mode']}_w{(r.get('windows') or [0])[-1]}_b{r['batch']}"
        for field, key in (("step_ms_p50", "step_ms"), ("rtf", "rtf"), ("dit_s", "dit_s"), ("vocoder_s", "vocoder_s")):
            runs.setdefault(f"{name}_{key}", []).append(r.get(field))
    return {k: _median(v) for k, v in runs.items()} | starts


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _dit_variants(out: Path) -> dict:
    """Step `ditvar` (ditvar*.txt, benchmarks/dit_speed.py's JSON lines): GPU ms of one DiT body call
    replayed as a CUDA graph per variant (`compiled`: as the configs run it) and rows, and each
    variant's output error against it."""
    keys: dict = {}
    lines = [line for path in sorted(out.glob("ditvar*.txt")) for line in path.read_text(errors="replace").splitlines()]
    for line in lines:
        if line.startswith("{") and '"graph_ms"' in line:
            r = json.loads(line)
            name = f"dit_{r.get('variant', 'compiled')}_rows{r['rows']}"
            keys[f"{name}_graph_ms"] = r["graph_ms"]
            if "max_rel_err" in r:
                keys[f"{name}_max_rel_err"] = r["max_rel_err"]
    return keys


def _activation(out: Path) -> dict:
    """benchmarks/antialias_speed.py RESULT lines (aa.txt): ms per call of one activation per channel
    count, transformers' module and ours (eager, compiled)."""
    return {f"aa_c{r['channels']}_{name}": r.get(name) for r in _results([out / "aa.txt"])
            for name in ("transformers_ms", "fused_eager_ms", "fused_compiled_ms")}


def _served(out: Path, bench: str, key: str) -> dict:
    """TTFP and RTF (p50) at c=1 and c=16 of one benched server."""
    levels = {c: _level(out / f"{bench}_c{c}.json") for c in (1, 16)}
    return {f"{key}_{what}_c{c}": _get(levels[c], field, "p50")
            for what, field in (("ttfp_ms", "ttfp_ms"), ("rtf", "rtf")) for c in (1, 16)}


def _mixed(out: Path, tag: str) -> dict:
    """MEDIA_KINDS `mixed` (media_<tag>_mixtext_<n>.json, media_<tag>_mixvideo_<n>.json): medians
    over the runs of the text chats' TTFP, RTF and stall p90 and of the video chat's TTFP."""
    texts = [_level(f) for f in sorted(out.glob(f"media_{tag}_mixtext_*.json"))]
    videos = [_level(f) for f in sorted(out.glob(f"media_{tag}_mixvideo_*.json"))]
    if not texts and not videos:
        return {}
    key = f"media_{tag}_mix"
    return {f"{key}_text_ttfp_ms": _median([_get(t, "ttfp_ms", "p50") for t in texts]),
            f"{key}_text_rtf": _median([_get(t, "rtf", "p50") for t in texts]),
            f"{key}_text_stall_ms_p90": _median([_get(t, "stall_ms", "p90") for t in texts]),
            f"{key}_video_ttfp_ms": _median([_get(v, "ttfp_ms", "p50") for v in videos]),
            f"{key}_runs": len(texts)}


def _prefix(out: Path, names=("prefix_on", "prefix_off")) -> dict:
    """Steps `prefix` / `qwen3prefix` (shared-prefix benches): TTFT and TTFP (p50) and RTF at c=1 and
    c=16 with prefix caching on and off, and the share of prompt tokens the cache spared."""
    keys = {}
    for name in names:
        keys |= _served(out, name, name)
        for c in (1, 16):
            lv = _level(out / f"{name}_c{c}.json")
            keys[f"{name}_ttft_ms_c{c}"] = _get(lv, "ttft_ms", "p50")
            prompt = _get(lv, "prompt_tokens")
            keys[f"{name}_cached_share_c{c}"] = round(lv["cached_tokens"] / prompt, 3) if prompt else None
    return keys


def _smcap(out: Path) -> dict:
    """Step `smcap`: per server smcap<P>[b...]: TTFP and RTF at c=1 and c=16, at 3/s, and its ready time."""
    keys = {}
    for c1 in sorted(out.glob("smcap*_c1.json")):
        name = c1.name.removesuffix("_c1.json")
        rate = _level(out / f"{name}_rate.json")
        keys |= _served(out, name, name) | {
            f"{name}_rate_ttfp_ms": _get(rate, "ttfp_ms", "p50"), f"{name}_rate_rtf": _get(rate, "rtf", "p50"),
            f"{name}_ready_s": _ready_s(out / f"serve_{name}.log")}
    return keys


def _rate_steps(out: Path, name: str = "rate", key: str = "rate") -> dict:
    """Each stage's steps during a step's first bench level (steps_<name>.json from
    benchmarks/step_log.py --bench): <key>_<stage>_{steps,mean_served,step_ms_p50,busy}."""
    path = out / f"steps_{name}.json"
    if not path.exists():
        return {}
    keys = {}
    for label, s in json.loads(path.read_text()).items():
        if "busy" not in s:  # (a summary of the server's whole life, not of the level)
            continue
        stage = label.split("-")[1]  # stage<id>-<name>-r<replica>
        keys |= {f"{key}_{stage}_steps": s["steps"], f"{key}_{stage}_mean_served": s["mean_served"],
                 f"{key}_{stage}_step_ms_p50": s["ms_p50"], f"{key}_{stage}_busy": s["busy"]}
    return keys


# Rate servers under another RATE_NAME (session.sh's step `rate`): files <name>_c16.json and
# steps_<name>.json -> keys <key>_*. ("rate2" was a second plain one: rate2_* keys mean rate_r2.json.)
NAMED_RATES = {"ratekv": "ratekv", "ratekv2": "ratekv2", "rate2": "rate_again"}


def _named_rates(out: Path) -> dict:
    keys = {}
    for name, key in NAMED_RATES.items():
        level = _level(out / f"{name}_c16.json")
        if level is not None:
            keys |= {f"{key}_ttfp_ms_c16": _get(level, "ttfp_ms", "p50"), f"{key}_rtf_c16": _get(level, "rtf", "p50"),
                     f"{key}_stall_ms_p90_c16": _get(level, "stall_ms", "p90")} | _rate_steps(out, name, key)
    return keys


def _variants(out: Path) -> dict:
    """Step `variants`: per variant v_<name> its 3/s level (v_<name>_*), c=1 / c=16 all at once
    (v_<name>srv_*) and each stage's steps in both (v_<name>_<stage>_*, v_<name>srv_<stage>_*)."""
    keys = {}
    for path in sorted(out.glob("v_*_c16.json")):
        name = path.name.removesuffix("_c16.json")
        if name.endswith("srv"):
            continue
        rate = _level(path)
        keys |= {f"{name}_ttfp_ms_rate": _get(rate, "ttfp_ms", "p50"), f"{name}_rtf_rate": _get(rate, "rtf", "p50"),
                 f"{name}_stall_ms_p90_rate": _get(rate, "stall_ms", "p90"),
                 f"{name}_ready_s": _ready_s(out / f"serve_{name}.log")}
        c16 = _level(out / f"{name}srv_c16.json")
        keys |= _rate_steps(out, name, name) | _served(out, f"{name}srv", f"{name}srv") | \
            _rate_steps(out, f"{name}srv", f"{name}srv") | {
                f"{name}srv_audio_s_per_wall_s_c16": _get(c16, "audio_s_per_wall_s"),
                f"{name}srv_stall_ms_p90_c16": _get(c16, "stall_ms", "p90")}
    return keys


def collect(out: Path) -> dict:
    c1, c16 = _level(out / "bench7b_c1.json"), _level(out / "bench7b_c16.json")
    full_c1, full_c16 = _level(out / "bench7b_full_c1.json"), _level(out / "bench7b_full_c16.json")
    ref = _level(out / "bench7b_c16_ref.json")
    return {
        "p1_runner_vs_vllm_bs1": _runner_ratio(out, 1),
        "p1_runner_vs_vllm_bs32": _runner_ratio(out, 32),
        # issue 2: the same ratio for the tiny thinker (float32)
        "tiny_runner_vs_vllm_bs1": _runner_ratio(out, 1, TINY),
        "tiny_runner_vs_vllm_bs32": _runner_ratio(out, 32, TINY),
        "tiny_loop_vs_vllm_bs1": _runner_ratio(out, 1, TINY, "omni-plain"),
        "tiny_loop_vs_vllm_bs32": _runner_ratio(out, 32, TINY, "omni-plain"),
        "p2_ttfp_ms_c1": _get(c1, "ttfp_ms", "p50"),
        "p2_ttfp_ms_c16": _get(c16, "ttfp_ms", "p50"),
        "p2_ttfp_ms_c1_full_payload": _get(full_c1, "ttfp_ms", "p50"),
        "p2_ttfp_ms_c16_full_payload": _get(full_c16, "ttfp_ms", "p50"),
        "p3_rtf_c1": _get(c1, "rtf", "p50"),
        "p3_rtf_c16": _get(c16, "rtf", "p50"),
        "p4_vs_hf_c16": _get(ref, "vs_reference"),
        "p5_hbm_fraction_bs1": _hbm_fraction(out),
        # step `splits`: FlashAttention's KV splits capped (p1 and p5 measured with it)
        "splits_runner_vs_vllm_bs1": _runner_ratio(out, 1, variant="splits"),
        "splits_runner_vs_vllm_bs32": _runner_ratio(out, 32, variant="splits"),
        "splits_hbm_fraction_bs1": _hbm_fraction(out, "splits"),
        "splits_vllm_hbm_fraction_bs1": _hbm_fraction(out, "splits", "vllm"),
        **_served(out, "splits", "splits"),
        # step `prefix`: a shared 1500-word system message, prefix caching on / off,
        # and runner_overhead.py with prefix caching on in both engines (variant `pc`)
        **_prefix(out),
        # ... each of its servers also benched as `main` (keys pcon_*, pcoff_*)
        **_served(out, "pcon", "pcon"), **_served(out, "pcoff", "pcoff"),
        "pc_runner_vs_vllm_bs1": _runner_ratio(out, 1, variant="pc"),
        "pc_runner_vs_vllm_bs32": _runner_ratio(out, 32, variant="pc"),
        "pc_hbm_fraction_bs1": _hbm_fraction(out, "pc"),
        # (`main` after another step's server starts from warm caches: not p6 cold)
        "p6_ready_s_cold": None if (out / "main_caches_warm.txt").exists() else _ready_s(out / "serve_bench7b.log"),
        "main_ready_s_warm_caches": _ready_s(out / "serve_bench7b.log") if (out / "main_caches_warm.txt").exists()
        else None,
        # the same config started again from its compile cache (step `warm`), or before that step
        # existed the full-payload server, which started second
        "p6_ready_s_warm": _ready_s(out / "serve_bench7b_warm.log") or _ready_s(out / "serve_bench7b_full.log"),
        # step `warm` benched too: a second sample of p2 and p3
        **_served(out, "bench7b_warm", "warm"),
        # warm, thinker and talker given kv_cache_memory_bytes: their engines build side by side
        "p6_ready_s_warm_fixed_kv": _ready_s(out / "serve_sized.log"),
        # /v1/audio/speech on the same server (omni-server bench --speech)
        **_served(out, "speech7b", "speech"),
        # step `media`: chats carrying an audio clip / an image / text alone, one server
        **_served(out, "media_audio", "media_audio"), **_served(out, "media_image", "media_image"),
        **_served(out, "media_text", "media_text"),
        # step `mmcompile`: the same with the thinker's media encoders compiled (compile_mm_encoder)
        **{k: v for n in ("audio", "image", "text") for k, v in _served(out, f"media_mmc_{n}", f"media_mmc_{n}").items()},
        "media_mmc_ready_s": _ready_s(out / "serve_media7b_mmc.log"),
        # step `video`: the config taking one video a chat; chats carrying a video / text alone
        **{k: v for n in ("video", "text") for k, v in _served(out, f"media_vid_{n}", f"media_vid_{n}").items()},
        "media_vid_ready_s": _ready_s(out / "serve_media7b_vid.log"),
        # step `mnbt`: the same with prefill chunks of MNBT tokens in the thinker and talker (8,192
        # through the thirty-first run, 2,048 after it: the configs' own went from 2,048 to 8,192 there)
        **{k: v for n in ("video", "text") for k, v in _served(out, f"media_mnbt_{n}", f"media_mnbt_{n}").items()},
        "media_mnbt_ready_s": _ready_s(out / "serve_media7b_mnbt.log"),
        # MEDIA_KINDS `mixed` in either: 15 text chats with one video chat arriving among them
        **_mixed(out, "vid"), **_mixed(out, "mnbt"),
        # step `rt`: the same prompts over the Realtime API (a session a request) and as chats, one server
        **{k: v for n in ("realtime", "rtaudio", "text") for k, v in _served(out, f"media_rt_{n}", f"media_rt_{n}").items()},
        # Qwen3-Omni-30B-A3B shapes, configs/qwen3_omni.yaml (session step `qwen3`)
        **_served(out, "qwen3", "qwen3"),
        "qwen3_ready_s": _ready_s(out / "serve_qwen3.log"),
        # the talker's code predictor compiled (former step `qwen3cp`; the config's since 2026-12-01's
        # eleventh run), then without it (step `qwen3eager`)
        **_served(out, "qwen3cp", "qwen3cp"),
        "qwen3cp_ready_s": _ready_s(out / "serve_qwen3cp.log"),
        **_served(out, "qwen3eager", "qwen3eager"),
        "qwen3eager_ready_s": _ready_s(out / "serve_qwen3eager.log"),
        # ... and with its thinker and talker capped at part of the SMs (step `qwen3cap`)
        **_served(out, "qwen3cap", "qwen3cap"),
        "qwen3cap_ready_s": _ready_s(out / "serve_qwen3cap.log"),
        # with its thinker's prefix caching on / off, each benched as `qwen3` and with a shared prefix (`qwen3prefix`)
        **_served(out, "qwen3pcon", "qwen3pcon"), **_served(out, "qwen3pcoff", "qwen3pcoff"),
        **_prefix(out, ("qwen3pcon_prefix", "qwen3pcoff_prefix")),
        # and under serve's own CUDA MPS daemon (step `qwen3mps`)
        **_served(out, "qwen3mps", "qwen3mps"),
        "qwen3mps_ready_s": _ready_s(out / "serve_qwen3mps.log"),
        # the 7B config under CUDA MPS (step `mps`), and with token2wav's compile too (MPS_FAST=1)
        **_served(out, "mps", "mps"),
        **_served(out, "mpsfast", "mpsfast"),
        # the 7B config with the vocoder's activations compiled (step `t2wact`)
        **_served(out, "t2wact", "t2wact"),
        "t2wact_ready_s": _ready_s(out / "serve_t2wact.log"),
        # growing windows up to 144 frames (step `w144`), and both with the activations (`t2wboth`)
        **_served(out, "w144", "w144"),
        "w144_ready_s": _ready_s(out / "serve_w144.log"),
        **_served(out, "t2wboth", "t2wboth"),
        "t2wboth_ready_s": _ready_s(out / "serve_t2wboth.log"),
        # t2wboth with windows growing on to 216 frames (step `t2wbig`)
        **_served(out, "t2wbig", "t2wbig"),
        "t2wbig_ready_s": _ready_s(out / "serve_t2wbig.log"),
        # the 7B config with the DiT's attention kernel pinned (step `attn`, DIT_ATTN: default cudnn)
        **_served(out, "attn", "attn"),
        "attn_ready_s": _ready_s(out / "serve_attn.log"),
        # the 7B config with token2wav limited to part of the SMs under MPS (step `mpspct`)
        **_served(out, "mpspct", "mpspct"),
        # the 7B config with the thinker at MPS's below-normal priority (step `thinkerlow`)
        **_served(out, "thinkerlow", "thinkerlow"),
        # the 7B config with token2wav at MPS's below-normal priority (step `t2wlow`)
        **_served(out, "t2wlow", "t2wlow"),
        # the 7B config with the talker at MPS's below-normal priority (step `talkerlow`)
        **_served(out, "talkerlow", "talkerlow"),
        # the 7B config under Poisson arrivals, at most 16 at once (step `rate`: c16 keys only)
        **_served(out, "rate", "rate"),
        # ... its second rate (RATE="3 2": rate_r2.json) and c=1 / c=16 all at once on its server (RATE_ALL=1)
        "rate2_ttfp_ms_c16": _get(_level(out / "rate_r2.json"), "ttfp_ms", "p50"),
        "rate2_rtf_c16": _get(_level(out / "rate_r2.json"), "rtf", "p50"),
        **_served(out, "ratesrv", "ratesrv"),
        **_rate_steps(out),
        **_named_rates(out),
        # serve-argument variants, one server each on one machine (step `variants`)
        **_variants(out),
        "rate_stall_ms_p90_c16": _get(_level(out / "rate_c16.json"), "stall_ms", "p90"),
        # the 7B config with the thinker and talker capped at P% of the SMs (step `smcap`)
        **_smcap(out),
        # the 7B config with the thinker (or more stages) quantized to FP8 at load (step `fp8`)
        **_served(out, "fp8", "fp8"),
        # the 7B config with one token2wav DiT graph per solver step (step `t2wstep`)
        **_served(out, "t2wstep", "t2wstep"),
        "t2wstep_ready_s": _ready_s(out / "serve_t2wstep.log"),
        # the 7B config with token2wav's fused q/k/v projection (step `qkv`)
        **_served(out, "qkv", "qkv"),
        "qkv_ready_s": _ready_s(out / "serve_qkv.log"),
        # the 7B config with token2wav's streams keeping their DiT keys and values (step `pastkv`)
        **_served(out, "pastkv", "pastkv"),
        "pastkv_ready_s": _ready_s(out / "serve_pastkv.log"),
        # ... its A/B on one machine with the stages' steps logged (step `pastkvab`)
        **_served(out, "pkvoff", "pkvoff"), **_rate_steps(out, "pkvoff", "pkvoff"),
        **_served(out, "pkvon", "pkvon"), **_rate_steps(out, "pkvon", "pkvon"),
        **_served(out, "ratekvsrv", "ratekvsrv"),
        # the 7B config with token2wav's vocoder activations as Triton kernels (step `t2wtriton`)
        **_served(out, "t2wtriton", "t2wtriton"),
        # the 7B config with the talker's attention in another vLLM backend (step `talkerattn`)
        **_served(out, "talkerattn", "talkerattn"),
        # the 7B config benched while py-spy samples its stages (step `spy`)
        **_served(out, "spy", "spy"),
        # the 7B config without its MPS daemon (step `nomps`; cuda_mps: auto in the config since 2026-12-01)
        **_served(out, "nomps", "nomps"),
        # the 7B config with token2wav's polyphase upsampling and compile (session step `t2wfast`),
        # then the same started again (compile from Inductor's cache)
        **_served(out, "t2wfast", "t2wfast"),
        "t2wfast_ready_s": _ready_s(out / "serve_t2wfast.log"),
        "t2wfast_ready_s_warm": _ready_s(out / "serve_t2wfast_warm.log"),
        # token2wav alone (session steps `t2w`, `t2wprof`): keys t2w_<mode>_b<batch>_{step_ms,rtf},
        # t2w_<mode>_start_s, t2wprof_<mode>_w<window>_b<batch>_*
        **_token2wav_speed(out),
        # one anti-aliased activation alone (session step `aa`): aa_c<channels>_<which>_ms
        **_activation(out),
        **_dit_variants(out),
        # the talker's decoder alone (session step `talker`): talker_<engine>_<sampling>_bs<batch>_tok_s
        **_talker(out),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(collect(a.dir), indent=2) + "\n")
    print(a.out.read_text())


if __name__ == "__main__":
    main()
