"""benchmarks/collect.py maps one device run's files onto the issue-5 result keys."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def _bench(path, **level):
    path.write_text(json.dumps({"config": {}, "levels": [level]}))


def _collect(out_dir):
    out = out_dir / "r.json"
    proc = subprocess.run([sys.executable, "benchmarks/collect.py", str(out_dir), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_collect_maps_run_outputs_to_result_keys(tmp_path):
    _bench(tmp_path / "bench7b_c1.json", ttfp_ms={"p50": 180.5}, rtf={"p50": 0.08})
    _bench(tmp_path / "bench7b_c16.json", ttfp_ms={"p50": 700.0}, rtf={"p50": 0.2})
    _bench(tmp_path / "bench7b_full_c1.json", ttfp_ms={"p50": 4000.0})
    _bench(tmp_path / "bench7b_full_c16.json", ttfp_ms={"p50": 9000.0}, errors=15)  # failures: not a measurement
    _bench(tmp_path / "bench7b_c16_ref.json", vs_reference=25.5)
    _bench(tmp_path / "speech7b_c1.json", ttfp_ms={"p50": 150.0}, rtf={"p50": 0.07})
    (tmp_path / "runner_a.txt").write_text(
        'noise\nRESULT {"model": "qwen2-7b", "mode": "vllm", "batch": 1, "tok_s": 200.0}\n'
        'RESULT {"model": "qwen2-7b", "mode": "omni-emit", "batch": 1, "tok_s": 198.0, "hbm_tb_s": 2.8}\n')
    (tmp_path / "runner_prof.txt").write_text(  # the profiled run: slowed by the profiler, not counted
        'RESULT {"model": "qwen2-7b", "mode": "omni-emit", "batch": 1, "tok_s": 150.0, "hbm_tb_s": 2.1}\n')
    (tmp_path / "runner_splits_omni.txt").write_text(  # step `splits`: its own keys, not p1 / p5
        'RESULT {"model": "qwen2-7b", "mode": "vllm", "batch": 1, "tok_s": 220.0, "hbm_tb_s": 3.1}\n'
        'RESULT {"model": "qwen2-7b", "mode": "omni-emit", "batch": 1, "tok_s": 231.0, "hbm_tb_s": 3.25}\n')
    (tmp_path / "runner_tiny_a.txt").write_text(
        'RESULT {"model": "/w/var/models/tiny-qwen2_5-omni", "mode": "vllm", "batch": 1, "tok_s": 900.0}\n'
        'RESULT {"model": "/w/var/models/tiny-qwen2_5-omni", "mode": "omni-emit", "batch": 1, "tok_s": 880.0}\n')
    (tmp_path / "serve_bench7b.log").write_text("... all 3 stages ready in 142.5 s; serving on http://x\n")
    (tmp_path / "serve_sized.log").write_text("... all 3 stages ready in 51.0 s; serving on http://x\n")
    (tmp_path / "serve_bench7b_warm.log").write_text("... all 3 stages ready in 49.5 s; serving on http://x\n")
    (tmp_path / "serve_bench7b_full.log").write_text("... all 3 stages ready in 70.0 s; serving on http://x\n")
    _bench(tmp_path / "bench7b_warm_c1.json", ttfp_ms={"p50": 190.0}, rtf={"p50": 0.09})
    _bench(tmp_path / "w144_c16.json", ttfp_ms={"p50": 1010.0}, rtf={"p50": 0.56})
    _bench(tmp_path / "t2wboth_c16.json", ttfp_ms={"p50": 990.0}, rtf={"p50": 0.52})
    (tmp_path / "serve_t2wboth.log").write_text("... all 3 stages ready in 61.0 s; serving on http://x\n")
    _bench(tmp_path / "qwen3eager_c1.json", ttfp_ms={"p50": 300.0}, rtf={"p50": 0.28})
    _bench(tmp_path / "thinkerlow_c1.json", ttfp_ms={"p50": 380.0}, rtf={"p50": 0.2})
    (tmp_path / "ditvar.txt").write_text(
        'noise\n{"frames": 144, "rows": 32, "device": "cuda", "compiled_ms": 17.7, "graph_ms": 5.48}\n'
        '{"variant": "fp8", "frames": 144, "rows": 32, "graph_ms": 5.84, "max_rel_err": 0.017}\n')
    _bench(tmp_path / "rate_c16.json", ttfp_ms={"p50": 1340.0}, rtf={"p50": 0.66})
    _bench(tmp_path / "rate_r2.json", ttfp_ms={"p50": 1030.0}, rtf={"p50": 0.47})
    _bench(tmp_path / "ratesrv_c1.json", ttfp_ms={"p50": 415.0}, rtf={"p50": 0.19})
    (tmp_path / "aa.txt").write_text(
        'RESULT {"channels": 96, "transformers_ms": 4.2, "fused_eager_ms": 6.0, "fused_compiled_ms": 1.1}\n')
    _bench(tmp_path / "t2wfast_c16.json", ttfp_ms={"p50": 900.0}, rtf={"p50": 0.5})
    (tmp_path / "serve_t2wfast_warm.log").write_text("... all 3 stages ready in 58.0 s; serving on http://x\n")
    (tmp_path / "t2w.txt").write_text(
        'RESULT {"mode": "graphs_bf16", "batch": 16, "step_ms_p50": 436.9, "rtf": 0.61}\n'
        'RESULT {"mode": "graphs_bf16_compiled", "batch": 1, "step_ms_p50": 67.9, "rtf": 0.1, "start_s": 190.5}\n')
    (tmp_path / "t2wprof.txt").write_text(
        'RESULT {"mode": "config", "batch": 16, "step_ms_p50": 340.0, "rtf": 0.5, "windows": [48, 48, 72], '
        '"dit_s": 2.5, "vocoder_s": 0.4}\n')
    _bench(tmp_path / "mpsfast_c16.json", ttfp_ms={"p50": 950.0}, rtf={"p50": 0.6})
    _bench(tmp_path / "t2wact_c16.json", ttfp_ms={"p50": 800.0}, rtf={"p50": 0.45})
    _bench(tmp_path / "mpspct_c1.json", ttfp_ms={"p50": 400.0}, rtf={"p50": 0.2})
    _bench(tmp_path / "talkerlow_c16.json", ttfp_ms={"p50": 850.0}, rtf={"p50": 0.47})
    _bench(tmp_path / "nomps_c1.json", ttfp_ms={"p50": 440.0}, rtf={"p50": 0.26})
    _bench(tmp_path / "qwen3cp_c16.json", ttfp_ms={"p50": 1100.0}, rtf={"p50": 0.3})
    (tmp_path / "serve_qwen3mps.log").write_text("... all 3 stages ready in 99.5 s; serving on http://x\n")
    (tmp_path / "talker_vllm_talker.txt").write_text(
        'RESULT {"model": "talker-7b", "sampling": "talker", "mode": "vllm", "batch": 1, "tok_s": 212.34}\n')
    (tmp_path / "talker_vllm_greedy.txt").write_text(
        'RESULT {"model": "talker-7b", "sampling": "greedy", "mode": "vllm", "batch": 16, "tok_s": 4000.0}\n')
    r = _collect(tmp_path)
    assert r["p1_runner_vs_vllm_bs1"] == 0.99 and r["p1_runner_vs_vllm_bs32"] is None
    assert (r["p2_ttfp_ms_c1"], r["p2_ttfp_ms_c16"], r["p3_rtf_c1"], r["p3_rtf_c16"]) == (180.5, 700.0, 0.08, 0.2)
    assert r["p2_ttfp_ms_c1_full_payload"] == 4000.0 and r["p2_ttfp_ms_c16_full_payload"] is None
    assert r["p5_hbm_fraction_bs1"] == round(2.8 / 4.3, 3)
    assert r["splits_runner_vs_vllm_bs1"] == 1.05 and r["splits_runner_vs_vllm_bs32"] is None
    assert (r["splits_hbm_fraction_bs1"], r["splits_vllm_hbm_fraction_bs1"]) == (round(3.25 / 4.3, 3), round(3.1 / 4.3, 3))
    assert r["p4_vs_hf_c16"] == 25.5 and r["p6_ready_s_cold"] == 142.5
    assert r["p6_ready_s_warm"] == 49.5  # the `warm` step's restart of the same config, not the full-payload one
    assert (r["warm_ttfp_ms_c1"], r["warm_rtf_c1"], r["warm_ttfp_ms_c16"]) == (190.0, 0.09, None)
    assert (r["w144_ttfp_ms_c16"], r["w144_rtf_c16"], r["w144_ready_s"]) == (1010.0, 0.56, None)
    assert (r["t2wboth_ttfp_ms_c16"], r["t2wboth_rtf_c16"], r["t2wboth_ready_s"]) == (990.0, 0.52, 61.0)
    assert (r["qwen3eager_ttfp_ms_c1"], r["qwen3eager_rtf_c1"], r["qwen3eager_ready_s"]) == (300.0, 0.28, None)
    assert (r["thinkerlow_ttfp_ms_c1"], r["thinkerlow_rtf_c1"], r["thinkerlow_ttfp_ms_c16"]) == (380.0, 0.2, None)
    assert (r["dit_compiled_rows32_graph_ms"], r["dit_fp8_rows32_graph_ms"], r["dit_fp8_rows32_max_rel_err"]) == \
        (5.48, 5.84, 0.017)
    assert (r["rate_ttfp_ms_c16"], r["rate2_ttfp_ms_c16"], r["rate2_rtf_c16"]) == (1340.0, 1030.0, 0.47)
    assert (r["ratesrv_ttfp_ms_c1"], r["ratesrv_rtf_c1"], r["ratesrv_ttfp_ms_c16"]) == (415.0, 0.19, None)
    assert (r["aa_c96_transformers_ms"], r["aa_c96_fused_eager_ms"], r["aa_c96_fused_compiled_ms"]) == (4.2, 6.0, 1.1)
    assert r["p6_ready_s_warm_fixed_kv"] == 51.0
    assert r["tiny_runner_vs_vllm_bs1"] == round(880 / 900, 3) and r["tiny_runner_vs_vllm_bs32"] is None
    assert (r["speech_ttfp_ms_c1"], r["speech_rtf_c1"], r["speech_ttfp_ms_c16"]) == (150.0, 0.07, None)
    assert (r["t2wfast_ttfp_ms_c16"], r["t2wfast_rtf_c16"], r["t2wfast_ttfp_ms_c1"]) == (900.0, 0.5, None)
    assert r["t2wfast_ready_s_warm"] == 58.0 and r["t2wfast_ready_s"] is None
    assert (r["t2w_graphs_bf16_b16_step_ms"], r["t2w_graphs_bf16_b16_rtf"]) == (436.9, 0.61)
    assert r["t2w_graphs_bf16_compiled_b1_step_ms"] == 67.9 and r["t2w_graphs_bf16_compiled_start_s"] == 190.5
    assert "t2w_graphs_bf16_start_s" not in r  # (no start time in that line)
    assert (r["t2wact_ttfp_ms_c16"], r["t2wact_rtf_c16"], r["t2wact_ready_s"]) == (800.0, 0.45, None)
    assert (r["mpspct_ttfp_ms_c1"], r["mpspct_rtf_c1"], r["mpspct_ttfp_ms_c16"]) == (400.0, 0.2, None)
    assert (r["talkerlow_ttfp_ms_c16"], r["talkerlow_rtf_c16"], r["talkerlow_ttfp_ms_c1"]) == (850.0, 0.47, None)
    assert (r["t2wprof_config_w72_b16_step_ms"], r["t2wprof_config_w72_b16_dit_s"],
            r["t2wprof_config_w72_b16_vocoder_s"]) == (340.0, 2.5, 0.4)
    assert (r["mpsfast_ttfp_ms_c16"], r["mpsfast_rtf_c16"], r["mps_ttfp_ms_c16"]) == (950.0, 0.6, None)
    assert (r["nomps_ttfp_ms_c1"], r["nomps_rtf_c1"], r["nomps_ttfp_ms_c16"]) == (440.0, 0.26, None)
    assert (r["qwen3cp_ttfp_ms_c16"], r["qwen3cp_rtf_c16"], r["qwen3cp_ready_s"]) == (1100.0, 0.3, None)
    assert (r["qwen3mps_ready_s"], r["qwen3mps_ttfp_ms_c1"]) == (99.5, None)
    assert r["talker_vllm_talker_bs1_tok_s"] == 212.3 and r["talker_vllm_greedy_bs16_tok_s"] == 4000.0


def test_p6_warm_comes_from_the_full_payload_server_without_the_warm_step(tmp_path):
    """Runs before step `warm` existed started the full-payload server second, from the cache."""
    (tmp_path / "serve_bench7b_full.log").write_text("... all 3 stages ready in 70.0 s; serving on http://x\n")
    r = _collect(tmp_path)
    assert r["p6_ready_s_warm"] == 70.0 and r["p6_ready_s_cold"] is None and r["warm_ttfp_ms_c1"] is None


def test_a_main_server_started_from_warm_caches_is_not_p6_cold(tmp_path):
    """session.sh marks `main` started after another step's server (its compile caches filled):
    that start is filed apart, not as p6 cold (the twenty-eighth run's 38 s read as cold)."""
    (tmp_path / "serve_bench7b.log").write_text("... all 3 stages ready in 38.1 s; serving on http://x\n")
    assert _collect(tmp_path)["p6_ready_s_cold"] == 38.1
    (tmp_path / "main_caches_warm.txt").write_text("/tmp/vc/torch_compile_cache\n")
    r = _collect(tmp_path)
    assert r["p6_ready_s_cold"] is None and r["main_ready_s_warm_caches"] == 38.1


def test_rate_step_keys_from_the_step_log_of_the_rate_level(tmp_path):
    # The rate step: stages' OMNI_STEP_LOG lines, step_log.py windowed to the bench level, collect's keys.
    _bench(tmp_path / "rate_c16.json", ttfp_ms={"p50": 1340.0}, rtf={"p50": 0.66}, started_at=1000.0, wall_s=10.0)
    logs = tmp_path / "steps_rate"
    logs.mkdir()
    # (a warm-up step before the level, then three steps in it, one only flushing; one after it)
    (logs / "stage0-thinker-r0.steps").write_text(
        "# pid 1\n990.0 1 1 50\n1000.5 2 2 8\n1001.0 3 3 10\n1002.0 1 0 1\n1011.0 4 4 9\n")
    (logs / "stage2-token2wav-r0.steps").write_text("# pid 2\n1003.0 8 8 400\n1005.0 16 12 600\n")
    proc = subprocess.run([sys.executable, "benchmarks/step_log.py", str(logs), "--bench", str(tmp_path / "rate_c16.json"),
                           "--json", str(tmp_path / "steps_rate.json")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "stage0-thinker-r0: 2 steps of 2.5 requests, 9.0 ms p50, 0.018 s (busy 0.002)" in proc.stdout
    r = _collect(tmp_path)
    assert (r["rate_thinker_steps"], r["rate_thinker_mean_served"], r["rate_thinker_step_ms_p50"],
            r["rate_thinker_busy"]) == (2, 2.5, 9.0, 0.002)
    assert (r["rate_token2wav_steps"], r["rate_token2wav_mean_served"], r["rate_token2wav_step_ms_p50"],
            r["rate_token2wav_busy"]) == (2, 10.0, 500.0, 0.1)
    assert r["rate_ttfp_ms_c16"] == 1340.0 and "rate_talker_steps" not in r


def test_smcap_step_keys_per_server(tmp_path):
    # Step `smcap`: one server per SM cap (a repeated cap's server gets a suffix), each benched at c=1,
    # c=16 and 3/s; a level with failed requests gives no numbers.
    for name, c1, c16, rate, ready in (("smcap100", 424.0, 913.0, 1428.0, 49.4), ("smcap50", 373.0, 780.0, 1251.0, 55.0),
                                       ("smcap50b", 380.0, 790.0, 1300.0, 51.0), ("smcap50_30", 371.0, 800.0, 1200.0, 50.0)):
        _bench(tmp_path / f"{name}_c1.json", ttfp_ms={"p50": c1}, rtf={"p50": 0.21})
        _bench(tmp_path / f"{name}_c16.json", ttfp_ms={"p50": c16}, rtf={"p50": 0.47})
        _bench(tmp_path / f"{name}_rate.json", ttfp_ms={"p50": rate}, rtf={"p50": 0.6},
               **({"errors": 2} if name == "smcap50b" else {}))
        (tmp_path / f"serve_{name}.log").write_text(f"... all 3 stages ready in {ready} s; serving on http://x\n")
    r = _collect(tmp_path)
    assert (r["smcap100_ttfp_ms_c1"], r["smcap100_ttfp_ms_c16"], r["smcap100_rate_ttfp_ms"]) == (424.0, 913.0, 1428.0)
    assert (r["smcap50_ttfp_ms_c1"], r["smcap50_rtf_c16"], r["smcap50_rate_rtf"], r["smcap50_ready_s"]) == \
        (373.0, 0.47, 0.6, 55.0)
    assert r["smcap50b_ttfp_ms_c16"] == 790.0 and r["smcap50b_rate_ttfp_ms"] is None
    assert r["smcap50_30_rate_ttfp_ms"] == 1200.0  # (SMCAP "50/30": thinker 50%, talker 30%)
    assert not any(k.startswith("qwen3cap") and v is not None for k, v in r.items())


def test_variants_step_keys_per_server(tmp_path):
    # Step `variants`: one server per VARIANTS entry (v_<name>), its 3/s level, then c=1 and c=16 all
    # at once (v_<name>srv_*); a level with failed requests gives no numbers.
    for name, rate, c16, errors in (("v_base", 1100.0, 820.0, 0), ("v_t2wlow", 1000.0, 760.0, 3)):
        _bench(tmp_path / f"{name}_c16.json", ttfp_ms={"p50": rate}, rtf={"p50": 0.6}, stall_ms={"p90": 250.0})
        _bench(tmp_path / f"{name}srv_c1.json", ttfp_ms={"p50": 360.0}, rtf={"p50": 0.19})
        _bench(tmp_path / f"{name}srv_c16.json", ttfp_ms={"p50": c16}, rtf={"p50": 0.4}, audio_s_per_wall_s=39.5,
               stall_ms={"p90": 0.0}, errors=errors)
        (tmp_path / f"serve_{name}.log").write_text("... all 3 stages ready in 45.0 s; serving on http://x\n")
    r = _collect(tmp_path)
    assert (r["v_base_ttfp_ms_rate"], r["v_base_rtf_rate"], r["v_base_stall_ms_p90_rate"], r["v_base_ready_s"]) == \
        (1100.0, 0.6, 250.0, 45.0)
    assert (r["v_basesrv_ttfp_ms_c1"], r["v_basesrv_ttfp_ms_c16"], r["v_basesrv_rtf_c16"],
            r["v_basesrv_audio_s_per_wall_s_c16"], r["v_basesrv_stall_ms_p90_c16"]) == (360.0, 820.0, 0.4, 39.5, 0.0)
    assert r["v_t2wlow_ttfp_ms_rate"] == 1000.0 and r["v_t2wlowsrv_ttfp_ms_c16"] is None
    assert r["v_t2wlowsrv_audio_s_per_wall_s_c16"] is None and r["v_t2wlowsrv_ttfp_ms_c1"] == 360.0
    assert not any(k.startswith("v_basesrv_ttfp_ms_rate") for k in r)


def test_prefix_step_keys(tmp_path):
    # Step `prefix`: the thinker's prefix caching on and off under one shared system message, and the
    # runner benchmark with caching on in both engines (its own keys, not p1 / p5).
    for v, ttft, cached in (("on", 60.0, 30000), ("off", 140.0, 0)):
        for c in (1, 16):
            _bench(tmp_path / f"prefix_{v}_c{c}.json", ttft_ms={"p50": ttft * c}, ttfp_ms={"p50": 300.0 + ttft},
                   rtf={"p50": 0.2}, prompt_tokens=40000, cached_tokens=cached)
    (tmp_path / "runner_pc_omni.txt").write_text(
        'RESULT {"model": "qwen2-7b", "mode": "vllm", "batch": 1, "tok_s": 200.0, "hbm_tb_s": 2.9}\n'
        'RESULT {"model": "qwen2-7b", "mode": "omni-emit", "batch": 1, "tok_s": 196.0, "hbm_tb_s": 2.84}\n')
    r = _collect(tmp_path)
    assert (r["prefix_on_ttft_ms_c1"], r["prefix_on_ttft_ms_c16"], r["prefix_off_ttfp_ms_c16"]) == (60.0, 960.0, 440.0)
    assert (r["prefix_on_cached_share_c1"], r["prefix_off_cached_share_c16"]) == (0.75, 0.0)
    assert r["pc_runner_vs_vllm_bs1"] == 0.98 and r["pc_hbm_fraction_bs1"] == round(2.84 / 4.3, 3)
    assert r["p1_runner_vs_vllm_bs1"] is None and r["p5_hbm_fraction_bs1"] is None


def test_mixed_runs_take_the_median_of_their_runs(tmp_path):
    # MEDIA_KINDS `mixed` (steps video / mnbt): 15 text chats and one video chat arriving among them,
    # n runs each; a run whose requests failed counts for nothing.
    runs = ((1040.0, 0.48, 0.0, 2143.0), (904.0, 0.45, 9.4, 2031.0), (950.0, 0.47, 4.0, 1982.0))
    for n, (ttfp, rtf, stall, video) in enumerate(runs, 1):
        _bench(tmp_path / f"media_mnbt_mixtext_{n}.json", ttfp_ms={"p50": ttfp}, rtf={"p50": rtf},
               stall_ms={"p90": stall})
        _bench(tmp_path / f"media_mnbt_mixvideo_{n}.json", ttfp_ms={"p50": video})
    _bench(tmp_path / "media_mnbt_mixvideo_4.json", ttfp_ms={"p50": 9999.0}, errors=1)
    r = _collect(tmp_path)
    assert (r["media_mnbt_mix_text_ttfp_ms"], r["media_mnbt_mix_text_rtf"], r["media_mnbt_mix_text_stall_ms_p90"]) == (950.0, 0.47, 4.0)
    assert (r["media_mnbt_mix_video_ttfp_ms"], r["media_mnbt_mix_runs"]) == (2031.0, 3)
    assert not any(k.startswith("media_vid_mix") for k in r)


def test_named_rate_servers_and_past_cache_ab_keys(tmp_path):
    # Step `rate` under RATE_NAME (its own files: <name>_c16.json, steps_<name>.json) and step
    # `pastkvab` (servers pkvoff / pkvon, their steps windowed to the c=16 level).
    _bench(tmp_path / "rate_c16.json", ttfp_ms={"p50": 1202.0}, rtf={"p50": 0.6}, stall_ms={"p90": 686.0})
    _bench(tmp_path / "ratekv_c16.json", ttfp_ms={"p50": 1101.0}, rtf={"p50": 0.63}, stall_ms={"p90": 558.0})
    _bench(tmp_path / "rate2_c16.json", ttfp_ms={"p50": 1222.0}, rtf={"p50": 0.62}, stall_ms={"p90": 683.0})
    _bench(tmp_path / "ratekv2_c16.json", ttfp_ms={"p50": 975.0}, rtf={"p50": 0.6}, errors=1)
    (tmp_path / "steps_ratekv.json").write_text(json.dumps({
        "stage2-token2wav-r0": {"steps": 50, "mean_served": 5.76, "ms_p50": 275.9, "busy": 0.935}}))
    for name, c16 in (("pkvoff", 845.7), ("pkvon", 818.0)):
        _bench(tmp_path / f"{name}_c1.json", ttfp_ms={"p50": 365.0}, rtf={"p50": 0.19})
        _bench(tmp_path / f"{name}_c16.json", ttfp_ms={"p50": c16}, rtf={"p50": 0.41})
    (tmp_path / "steps_pkvon.json").write_text(json.dumps({
        "stage2-token2wav-r0": {"steps": 9, "mean_served": 16.0, "ms_p50": 399.0, "busy": 0.793},
        "stage1-talker-r0": {"steps": 502, "mean_served": 15.97, "ms_p50": 5.38}}))  # (no busy: not windowed)
    r = _collect(tmp_path)
    assert (r["rate_ttfp_ms_c16"], r["rate_stall_ms_p90_c16"]) == (1202.0, 686.0)
    assert (r["ratekv_ttfp_ms_c16"], r["ratekv_rtf_c16"], r["ratekv_stall_ms_p90_c16"]) == (1101.0, 0.63, 558.0)
    assert (r["ratekv_token2wav_steps"], r["ratekv_token2wav_busy"]) == (50, 0.935)
    assert r["rate_again_ttfp_ms_c16"] == 1222.0 and "ratekv2_ttfp_ms_c16" not in r  # (failed requests: no numbers)
    assert (r["pkvoff_ttfp_ms_c16"], r["pkvon_ttfp_ms_c16"], r["pkvon_rtf_c1"]) == (845.7, 818.0, 0.19)
    assert (r["pkvon_token2wav_steps"], r["pkvon_token2wav_step_ms_p50"]) == (9, 399.0) and "pkvon_talker_steps" not in r


def test_repeated_token2wav_runs_take_the_median_and_the_first_start_and_profiled_talkers_are_left_out(tmp_path):
    """Steps t2w / pastkv / pastkvab all append to t2w.txt: a timing key is the median of its runs,
    a start time the first run's (a second mode in one process starts warm); the talker's
    profiled repeat (talker_prof_*) is no decode-speed sample."""
    line = 'RESULT {{"mode": "config_past_cache", "batch": 16, "step_ms_p50": {}, "rtf": {}{}}}\n'
    (tmp_path / "t2w.txt").write_text(line.format(300.0, 0.3, ', "start_s": 90.0') + line.format(200.0, 0.2, "")
                                      + line.format(250.0, 0.25, ', "start_s": 5.0'))
    (tmp_path / "talker_omni-plain_talker.txt").write_text(
        'RESULT {"model": "talker-7b", "sampling": "talker", "mode": "omni-plain", "batch": 1, "tok_s": 300.0}\n')
    (tmp_path / "talker_prof_talker.txt").write_text(
        'RESULT {"model": "talker-7b", "sampling": "talker", "mode": "omni-plain", "batch": 1, "tok_s": 120.0}\n')
    r = _collect(tmp_path)
    assert (r["t2w_config_past_cache_b16_step_ms"], r["t2w_config_past_cache_b16_rtf"]) == (250.0, 0.25)
    assert r["t2w_config_past_cache_start_s"] == 90.0
    assert r["talker_omni-plain_talker_bs1_tok_s"] == 300.0
