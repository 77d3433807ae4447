"""`omni-server bench` against the running tiny server: a real load run with sane numbers."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.conftest import REPO


def _bench(base_url: str, out, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`omni-server bench` against `base_url` (model omni-tiny), JSON written to `out`."""
    return subprocess.run(
        [sys.executable, "-m", "omni_server.cli", "bench", "--base-url", base_url, "--model", "omni-tiny",
         *args, "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_bench_reports_every_level(text_server, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench(text_server.base_url, out, "--concurrency", "1", "4", "--requests", "4", "--max-tokens", "12",
                  "--prompt-words", "30")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    for lv in result["levels"]:
        assert lv["requests"] == 4 and lv["errors"] == 0
        assert lv["output_tokens"] == 4 * 12  # ignore_eos: every request runs to max_tokens
        assert lv["output_tok_s"] > 0
        assert 0 < lv["ttft_ms"]["p50"] <= lv["latency_ms"]["p50"] <= lv["latency_ms"]["p99"]
    assert "c=4" in proc.stdout


def test_arrivals_are_a_reproducible_poisson_schedule():
    from omni_server.bench.runner import arrivals

    assert arrivals(3, None) == [0.0, 0.0, 0.0]
    a = arrivals(2000, 10.0, seed=1)
    assert a == arrivals(2000, 10.0, seed=1) != arrivals(2000, 10.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.1) < 0.01  # mean gap 1 / rate


def test_bench_request_rate_spreads_the_arrivals(text_server, tmp_path):
    from omni_server.bench.runner import arrivals

    out = tmp_path / "bench.json"
    t0 = time.time()
    proc = _bench(text_server.base_url, out, "--concurrency", "4", "--requests", "4", "--max-tokens", "4",
                  "--prompt-words", "10", "--request-rate", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [lv] = json.loads(out.read_text())["levels"]
    assert lv["errors"] == 0 and lv["request_rate"] == 8.0
    assert t0 < lv["started_at"] < lv["started_at"] + lv["wall_s"] < time.time()  # (Unix time)
    assert lv["wall_s"] > arrivals(4, 8.0)[-1]  # the last request left on its schedule
    bad = _bench(text_server.base_url, out, "--request-rate", "0")
    assert bad.returncode == 2 and "--request-rate" in bad.stderr


def test_bench_audio_reports_ttfp_and_rtf(speech_server, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench(speech_server.base_url, out, "--concurrency", "2", "--requests", "2", "--max-tokens", "8",
                  "--prompt-words", "20", "--audio", "--voice", "Ethan")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (lv,) = json.loads(out.read_text())["levels"]
    assert lv["errors"] == 0 and lv["output_tokens"] == 2 * 8
    # Each codec token -> 2 mel frames -> 2 * 240 samples at 24 kHz; the tiny talker stops by 64 tokens.
    samples = round(lv["audio_s"] * 24000)
    assert 0 < samples <= 2 * 64 * 480 and samples % 480 == 0
    assert 0 < lv["ttft_ms"]["p50"] <= lv["ttfp_ms"]["p50"] <= lv["latency_ms"]["p99"]
    assert lv["ttfp_ms"]["p50"] <= lv["last_packet_ms"]["p50"] <= lv["latency_ms"]["p99"]
    assert lv["rtf"]["p50"] > 0 and lv["audio_s_per_wall_s"] > 0
    assert "TTFP" in proc.stdout
    assert 0 <= lv["stall_ms"]["p50"] <= lv["stall_ms"]["p90"] <= lv["stall_ms"]["max"]
    assert 0 <= lv["stalled_requests"] <= 2
    # Per-stage profile over the level: every stage stepped; only the thinker sends tensors to a
    # stage (hidden states to the talker; the talker sends token2wav codes as ids).
    thinker, talker, t2w = lv["stages"]
    assert [s["stage_id"] for s in lv["stages"]] == [0, 1, 2]
    for s in lv["stages"]:
        assert s["steps"] > 0 and s["step_ms_mean"] > 0 and 0 < s["busy"] and s["batch_mean"] >= 1
    # Each stage's first output comes after the one it waits for (ms from the request's start).
    assert 0 < thinker["first_output_ms"] < talker["first_output_ms"] < t2w["first_output_ms"]
    assert talker["steps"] >= 8  # at least one step per codec token of the shortest reply
    assert thinker["payload_mb"] > 0 and talker["payload_mb"] == 0 and t2w["payload_mb"] == 0


def test_bench_reference_runs_transformers_on_the_same_prompts(speech_server, tiny_models, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench(speech_server.base_url, out, "--concurrency", "1", "--requests", "2", "--max-tokens", "8",
                  "--prompt-words", "20", "--audio", "--reference", str(tiny_models["tiny-qwen2_5-omni"]),
                  "--reference-talker-max-tokens", "64", "--reference-requests", "2", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    ref, (lv,) = result["reference"], result["levels"]
    assert ref["device"] == "cpu" and ref["requests"] == 2 and ref["output_tokens"] == 2 * 8
    # The tiny talker rarely stops by itself: 64 codes -> 64 * 2 mel frames * 240 samples each.
    assert 0 < ref["audio_s"] <= 2 * 64 * 480 / 24000 and ref["rtf"]["p50"] > 0
    assert lv["vs_reference"] == round(lv["audio_s_per_wall_s"] / ref["audio_s_per_wall_s"], 3)
    assert "reference (transformers, cpu)" in proc.stdout


def _wav_header(rate: int) -> bytes:
    # The 44-byte header of a streamed WAV: sizes unknown (0xFFFFFFFF), 16-bit mono.
    return (b"RIFF" + b"\xff" * 4 + b"WAVEfmt " + (16).to_bytes(4, "little") + (1).to_bytes(2, "little")
            + (1).to_bytes(2, "little") + rate.to_bytes(4, "little") + (2 * rate).to_bytes(4, "little")
            + (2).to_bytes(2, "little") + (16).to_bytes(2, "little") + b"data" + b"\xff" * 4)


def test_playback_stalls_count_the_gaps_a_player_would_wait():
    from omni_server.bench.runner import _WavStream

    rate = 1000
    second = b"\0\0" * rate
    w = _WavStream(t0=0.0)
    w.add(_wav_header(rate), t=0.1)  # header only: playback starts with the first samples
    w.add(second, t=0.5)             # plays 0.5 -> 1.5
    w.add(second, t=1.2)             # in time: 1.5 -> 2.5
    w.add(second, t=3.0)             # 0.5 s late: 3.0 -> 4.0
    w.add(b"\0\0" * (rate // 2), t=4.25)  # 0.25 s late
    assert w.seconds == 3.5
    assert abs(w.stall_s - 0.75) < 1e-9
    assert w.first_s == 0.1 and w.last_s == 4.25  # (the header counts as the first packet)


def test_bench_speech_drives_the_speech_endpoint(speech_server, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench(speech_server.base_url, out, "--concurrency", "2", "--requests", "2", "--prompt-words", "12",
                  "--speech", "--voice", "Chelsie")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (lv,) = json.loads(out.read_text())["levels"]
    assert lv["errors"] == 0 and lv["ttft_ms"]["p50"] is None
    # Codec tokens (usage.output_tokens): 2 mel frames = 2 * 240 samples at 24 kHz each.
    assert 0 < lv["output_tokens"] <= 2 * 64  # (audio_s is rounded to 10 ms: half a code)
    assert abs(lv["audio_s"] * 24000 - lv["output_tokens"] * 480) <= 120
    assert 0 < lv["ttfp_ms"]["p50"] <= lv["latency_ms"]["p99"] and lv["rtf"]["p50"] > 0
    assert lv["stall_ms"]["max"] >= 0
    # The speech endpoint skips no stage: the thinker reads the text (one prefill), then talker and token2wav.
    assert all(s["steps"] > 0 for s in lv["stages"])


def test_bench_speech_has_no_reference_counterpart(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "bench", "--model", "m", "--speech",
                           "--reference", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--reference" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_shared_prefix_reports_what_the_prefix_cache_spared(speech_server, tmp_path):
    """Every chat opens with one long system message: after the first, each starts on the text
    stage's prefix cache (whole 128-token blocks on the CPU), and the level adds up the usage."""
    out = tmp_path / "bench.json"
    proc = _bench(speech_server.base_url, out, "--concurrency", "1", "--requests", "3", "--max-tokens", "4",
                  "--prompt-words", "10", "--shared-prefix-words", "200", "--audio")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (lv,) = json.loads(out.read_text())["levels"]
    assert lv["errors"] == 0 and lv["prompt_tokens"] > 3 * 200
    assert 2 * 128 <= lv["cached_tokens"] < lv["prompt_tokens"] and lv["cached_tokens"] % 128 == 0
    assert "cached)" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "omni_server.cli", "bench", "--model", "m", "--speech",
                          "--shared-prefix-words", "9"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--shared-prefix-words" in bad.stderr and "Traceback" not in bad.stderr


def test_percentiles_interpolate_between_the_nearest_values():
    from omni_server.bench.runner import _pct

    assert _pct([], 50) is None and _pct([7.0], 99) == 7.0
    assert _pct([1, 2], 50) == 1.5 and _pct([4, 1, 3, 2], 50) == 2.5
    assert _pct(list(range(1, 17)), 50) == 8.5  # (rounding the rank picked 9 of 16)
    assert _pct(list(range(1, 17)), 90) == 14.5 and _pct([0, 10], 99) == 9.9


def _chat_chunk(content: str | None = None, finish: str | None = None, usage: bool = False) -> str:
    choice = {"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}
    body = {"choices": [] if usage else [choice]}
    if usage:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    return "data: " + json.dumps(body) + "\n\n"


def test_a_cut_or_malformed_stream_is_that_requests_error_not_a_success_or_the_runs_end():
    """Replies that end before their finish, lack the usage asked for, or hold an event that is
    not JSON count as errors of their own requests; the other requests of the level still count."""
    import asyncio

    import httpx

    from omni_server.bench.runner import BenchConfig, run_bench

    whole = _chat_chunk("hi") + _chat_chunk("!", finish="stop") + _chat_chunk(usage=True) + "data: [DONE]\n\n"
    replies = {
        0: whole,
        1: _chat_chunk("hi"),  # connection closed after the first piece
        2: _chat_chunk("hi") + _chat_chunk("!", finish="stop") + "data: [DONE]\n\n",  # no usage chunk
        3: 'data: {"choices": [\n\n',  # not JSON
        4: whole,
    }
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/omni/stages"):
            return httpx.Response(404)
        i = len(seen)
        seen.append(i)
        return httpx.Response(200, text=replies[i], headers={"content-type": "text/event-stream"})

    cfg = BenchConfig(base_url="http://bench.test", model="m", concurrency=[1], requests_per_level=5)
    result = asyncio.run(run_bench(cfg, progress=lambda *a: None, transport=httpx.MockTransport(handler)))
    (lv,) = result["levels"]
    assert lv["requests"] == 5 and lv["errors"] == 3
    assert lv["output_tokens"] == 2 * 2  # the two whole replies' usage
    text = " ".join(lv["error_examples"])
    assert "[DONE]" in text and "usage" in text and "JSONDecodeError" in text


def test_bench_refuses_counts_below_one(tmp_path):
    for flag in ("--requests", "--reference-requests", "--concurrency"):
        proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "bench", "--model", "m", flag, "0"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and f"{flag} must be at least 1" in proc.stderr, proc.stderr


def test_the_wait_for_a_concurrency_slot_is_reported_apart_from_the_requests_times():
    """Arrivals faster than one slot serves: each later request waits for the one before; that
    wait shows as `queue_wait_ms`, and latency / TTFT start at the send, as the server saw them."""
    import asyncio

    import httpx

    from omni_server.bench.runner import BenchConfig, run_bench

    reply = _chat_chunk("hi", finish="stop") + _chat_chunk(usage=True) + "data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/omni/stages"):
            return httpx.Response(404)
        await asyncio.sleep(0.2)
        return httpx.Response(200, text=reply, headers={"content-type": "text/event-stream"})

    cfg = BenchConfig(base_url="http://bench.test", model="m", concurrency=[1], requests_per_level=4,
                      request_rate=1000.0)  # (all four arrive within a few ms)
    (lv,) = asyncio.run(run_bench(cfg, progress=lambda *a: None, transport=httpx.MockTransport(handler)))["levels"]
    assert lv["errors"] == 0
    assert 150 < lv["latency_ms"]["p50"] < 400 and lv["latency_ms"]["p99"] < 400  # one reply's 0.2 s each
    assert 550 < lv["queue_wait_ms"]["max"] < 1000  # the fourth waited for three replies
    cfg.request_rate, cfg.concurrency = None, [4]
    (lv,) = asyncio.run(run_bench(cfg, progress=lambda *a: None, transport=httpx.MockTransport(handler)))["levels"]
    assert lv["queue_wait_ms"]["max"] < 100  # a slot for each


def test_bench_refuses_a_reference_that_is_no_checkpoint_before_any_level(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "bench", "--model", "m", "--base-url",
                           "http://127.0.0.1:9", "--reference", str(tmp_path / "nowhere")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "no config.json" in proc.stderr and "c=" not in proc.stdout  # (no level ran)


def test_a_failing_reference_keeps_the_levels_measured(tmp_path):
    import asyncio

    import httpx

    from omni_server.bench.runner import BenchConfig, run_bench

    reply = _chat_chunk("hi", finish="stop") + _chat_chunk(usage=True) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/omni/stages"):
            return httpx.Response(404)
        return httpx.Response(200, text=reply, headers={"content-type": "text/event-stream"})

    (tmp_path / "config.json").write_text("{}")  # (no model transformers knows)
    cfg = BenchConfig(base_url="http://bench.test", model="m", concurrency=[1], requests_per_level=2,
                      reference=str(tmp_path), reference_device="cpu")
    result = asyncio.run(run_bench(cfg, progress=lambda *a: None, transport=httpx.MockTransport(handler)))
    assert result["levels"][0]["requests"] == 2 and result["levels"][0]["errors"] == 0
    assert result["reference"]["error"]


def test_bench_takes_the_openai_clients_base_url_too(text_server, tmp_path):
    """`--base-url http://host:port/v1` (the openai client's form) reaches the same routes."""
    out = tmp_path / "bench.json"
    proc = _bench(text_server.base_url + "/v1/", out, "--concurrency", "1", "--requests", "1", "--max-tokens", "2",
                  "--prompt-words", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["levels"][0]["errors"] == 0


def test_bench_sends_an_image_and_audio_in_every_chat(text_server, tmp_path):
    """--image / --input-audio: each chat carries a generated PNG and WAV clip, which the thinker
    expands to their placeholder tokens (the usage's prompt tokens grow by them)."""
    plain, media = tmp_path / "plain.json", tmp_path / "media.json"
    common = ["--concurrency", "2", "--requests", "2", "--max-tokens", "4", "--prompt-words", "10"]
    assert _bench(text_server.base_url, plain, *common).returncode == 0
    proc = _bench(text_server.base_url, media, *common, "--image", "112x84", "--input-audio", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (lp,), (lm,) = json.loads(plain.read_text())["levels"], json.loads(media.read_text())["levels"]
    assert lm["errors"] == 0 and lm["output_tokens"] == 2 * 4
    # 112x84 pixels: 12 merged patch tokens; 1 s of audio: 25 tokens (two requests)
    assert lm["prompt_tokens"] - lp["prompt_tokens"] >= 2 * (12 + 25 - 4), (lm["prompt_tokens"], lp["prompt_tokens"])
    config = json.loads(media.read_text())["config"]
    assert config["image"] == [112, 84] and isinstance(config["media_seed"], int)  # (drawn: in the JSON)


def test_bench_sends_a_video_in_every_chat(chunked_server, tmp_path):
    """--video WxH:SECONDS: each chat carries a generated MP4 at 2 frames a second, which the thinker
    expands to its frames' tokens (64x48: 140 per two frames, grown to the processor's least pixels)."""
    plain, media = tmp_path / "plain.json", tmp_path / "media.json"
    common = ["--concurrency", "2", "--requests", "2", "--max-tokens", "4", "--prompt-words", "10"]
    assert _bench(chunked_server.base_url, plain, *common).returncode == 0
    proc = _bench(chunked_server.base_url, media, *common, "--video", "64x48:2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (lp,), (lm,) = json.loads(plain.read_text())["levels"], json.loads(media.read_text())["levels"]
    assert lm["errors"] == 0 and lm["output_tokens"] == 2 * 4
    # (each request: its placeholder and the vision start and end tokens around 2 x 140 video tokens)
    assert lm["prompt_tokens"] - lp["prompt_tokens"] == 2 * (2 * 140 + 2), (lm["prompt_tokens"], lp["prompt_tokens"])
    assert json.loads(media.read_text())["config"]["video"] == [64, 48, 2.0]


def test_bench_media_parts_differ_per_request_and_bad_sizes_are_refused():
    import base64
    import io

    from PIL import Image

    from omni_server.bench.runner import BenchConfig, media_parts

    cfg = BenchConfig(base_url="http://x", model="m", image=(64, 32), input_audio_s=0.5, media_seed=1)
    a, b = media_parts(0, cfg), media_parts(1, cfg)
    assert [p["type"] for p in a] == ["image_url", "input_audio"] and a == media_parts(0, cfg)
    other_run = media_parts(0, BenchConfig(base_url="http://x", model="m", image=(64, 32), input_audio_s=0.5,
                                           media_seed=2))
    for k in range(2):  # every part differs between requests and between runs (the server's caches)
        assert len({str(a[k]), str(b[k]), str(other_run[k])}) == 3
    assert len({str(media_parts(i, cfg)[0]) for i in range(0, 600, 7)}) == len(range(0, 600, 7))
    png = base64.b64decode(a[0]["image_url"]["url"].split(",", 1)[1])
    assert Image.open(io.BytesIO(png)).size == (64, 32)
    assert len(base64.b64decode(a[1]["input_audio"]["data"])) == 44 + 2 * 8000  # 0.5 s of 16 kHz pcm16
    from tests.media import kept_frames

    cfg = BenchConfig(base_url="http://x", model="m", video=(40, 24, 1.5), media_seed=1)
    videos = [media_parts(i, cfg)[0]["video_url"]["url"] for i in range(3)]
    assert len(set(videos)) == 3 and videos[0] == media_parts(0, cfg)[0]["video_url"]["url"]
    assert kept_frames(videos[0]).shape == (3, 24, 40, 3)  # 2 frames a second, as the server keeps them
    for args in (["--image", "64"], ["--image", "0x5"], ["--speech", "--image", "8x8"],
                 ["--video", "64x48"], ["--video", "64x48:0"], ["--video", "0x5:1"], ["--video", "8x8:x"],
                 ["--speech", "--video", "8x8:1"],
                 ["--input-audio", "-1"], ["--input-audio", "nan"], ["--input-audio", "inf"],
                 ["--reference", "/nowhere", "--input-audio", "1"]):
        proc = subprocess.run([sys.executable, "-m", "omni_server.cli", "bench", "--model", "m", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and "error:" in proc.stderr, args


def test_bench_realtime_drives_realtime_sessions(speech_server, tmp_path):
    """--realtime: one Realtime API session a request (prompt and a clip as one user item, a shared
    system prefix as the session's instructions), spoken replies timed from response.create."""
    out = tmp_path / "bench.json"
    proc = _bench(speech_server.base_url, out, "--concurrency", "2", "--requests", "2", "--prompt-words", "12",
                  "--max-tokens", "8", "--realtime", "--audio", "--input-audio", "1", "--shared-prefix-words", "20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (lv,) = json.loads(out.read_text())["levels"]
    assert lv["errors"] == 0, lv["error_examples"]
    assert 0 < lv["output_tokens"] <= 2 * 8 and lv["prompt_tokens"] > 2 * 40  # (prefix, prompt and clip)
    assert 0 < lv["ttft_ms"]["p50"] <= lv["latency_ms"]["p50"]
    assert 0 < lv["ttfp_ms"]["p50"] <= lv["latency_ms"]["p99"] and lv["audio_s"] > 0 and lv["rtf"]["p50"] > 0
    bad = _bench(speech_server.base_url, out, "--realtime", "--image", "64x64")
    assert bad.returncode == 2 and "--realtime" in bad.stderr
