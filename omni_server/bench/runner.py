"""HTTP load generator: fixed prompt set, concurrency levels, streaming chat requests.

Per level it reports TTFT (first text delta), end-to-end latency (p50/p90/p99), output tokens/s
(completion tokens from the usage chunk / wall time), errors, and the client-side queue wait (a
request's scheduled arrival to its send, when the level's concurrency cap holds it back; every
other time starts at the send); with `audio`, also TTFP (first
audio data delta), seconds of audio per wall second, RTF (request latency / its audio duration) and
playback stalls (how long a player starting at the first packet would wait for later packets).
Per stage (`stages`, from the stats route before and after the level): steps, mean step time, busy
fraction of the level's wall time, mean batch, payload MB sent to other stages, backpressure pauses,
mean time from a request's start to the stage's first output for it.
With `shared_prefix_words`, every chat opens with the same system message of that many words (a long
shared instruction, as many deployments send): what the text stage's prefix cache spares shows in
TTFT / TTFP, and each level reports prompt and cached tokens from the usage chunks.
With `speech`, the requests go to /v1/audio/speech instead (each prompt is the text to speak,
streamed as SSE events): the same audio numbers, no TTFT.
With `realtime`, each request is a session of the Realtime API (`/v1/realtime` over a WebSocket, turns
ended by the client): the prompt as a user item (with `input_audio_s`, a generated clip in it too),
then `response.create`; times start at that event: TTFT is the first transcript (or text) delta,
TTFP the first audio delta. The answer's length is the model's (no `ignore_eos` there): at most
`max_tokens`.
With `reference`, transformers' own pipeline runs the same prompts in this process afterwards, and
each level reports its throughput relative to it (`vs_reference`).
With `image` / `input_audio_s` / `video`, every chat's user turn also carries a generated image /
WAV clip / MP4 video, different in each request: the thinker's media processing and encoders are
part of what is timed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace

import httpx

from omni_server.wire.messages import STAGE_COUNTERS

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog while the sun sets behind the hills.",
    "A small model can still be useful when it is used to test the plumbing of a large system.",
    "The weather is nice and warm, so we decided to walk to the park near the river.",
    "Speech synthesis turns written text into audio that people can listen to.",
    "Yesterday it rained all afternoon, but this morning the sky was clear and blue.",
]


def shared_prefix(words: int) -> str:
    """The system message every chat of a shared-prefix bench opens with (about `words` words)."""
    text, k = [], 0
    while sum(len(t.split()) for t in text) < words:
        text.append(_SENTENCES[k % len(_SENTENCES)])
        k += 1
    return "Follow these notes when you answer. " + " ".join(text)


def prompt(i: int, words: int) -> str:
    """Deterministic prompt number i of about `words` words."""
    text, k = [], i
    while sum(len(t.split()) for t in text) < words:
        text.append(_SENTENCES[k % len(_SENTENCES)])
        k += 1
    return f"Request {i}. " + " ".join(text) + " Please answer at length."


@dataclass
class BenchConfig:
    base_url: str
    model: str
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    requests_per_level: int | None = None  # default: max(8, 4 * concurrency)
    prompt_words: int = 75  # ~100 tokens with a typical tokenizer
    max_tokens: int = 100
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    # Ask for speech too (modalities text + audio, wav); voice None = the server's default.
    audio: bool = False
    voice: str | None = None
    # Drive /v1/audio/speech instead (the prompt is the text spoken; SSE events, wav): TTFP, RTF,
    # stalls; no TTFT, and `output_tokens` counts codec tokens. Implies `audio`.
    speech: bool = False
    # Drive the Realtime API instead (one WebSocket session a request; see the module's docstring).
    realtime: bool = False
    # A checkpoint dir: also run transformers' pipeline on the same prompts (one at a time) in this
    # process, and report each level against it. Its talker stops at `reference_talker_max_tokens`
    # (set it to the server's talker max_tokens for a like-for-like audio length).
    reference: str | None = None
    reference_device: str | None = None  # default: cuda if available
    reference_talker_max_tokens: int = 500
    reference_requests: int = 4  # one at a time, after a warm-up request
    # Requests per second arriving as a Poisson process (exponential gaps drawn from `arrival_seed`:
    # the same schedule every run), each level's concurrency still the cap; None: all at once.
    request_rate: float | None = None
    arrival_seed: int = 0
    shared_prefix_words: int = 0  # > 0: every chat opens with the same system message this long
    # Media in every chat's user turn, different in each request (no processor-cache hits): a PNG
    # image of this (width, height), and/or a WAV clip of this many seconds (16 kHz tones).
    image: tuple[int, int] | None = None
    input_audio_s: float = 0.0
    # and/or an MP4 video of (width, height, seconds) at 2 frames a second (the frames the server keeps).
    video: tuple[int, int, float] | None = None
    # Written into every image and clip with the request's number, so no two are alike, in a run or
    # across runs against one server (its caches are keyed by the media's bytes). None: drawn at random.
    media_seed: int | None = None


def media_parts(i: int, cfg: BenchConfig) -> list[dict]:
    """Request i's media content parts (built before its level's clock starts; the same for the same
    `media_seed`)."""
    parts, seed = [], cfg.media_seed or 0
    if cfg.image:
        parts.append({"type": "image_url", "image_url": {"url": _image_data_url(seed, i, *cfg.image)}})
    if cfg.video:
        parts.append({"type": "video_url", "video_url": {"url": _video_data_url(seed, i, *cfg.video)}})
    if cfg.input_audio_s > 0 and cfg.realtime:  # (a Realtime item's part: 24 kHz PCM16)
        parts.append({"type": "input_audio", "audio": _tone_pcm_b64(seed, i, cfg.input_audio_s)})
    elif cfg.input_audio_s > 0:
        parts.append({"type": "input_audio", "input_audio": {"data": _tone_wav_b64(seed, i, cfg.input_audio_s),
                                                             "format": "wav"}})
    return parts


def _image_data_url(seed: int, i: int, width: int, height: int) -> str:
    import io

    import numpy as np
    from PIL import Image

    # Smooth colour ramps (small PNGs) with the seed and request number in the first pixels' bytes.
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x + 7 * i) % 256, (y + 13 * i) % 256, (x + y + 29 * i) % 256], axis=-1).astype(np.uint8)
    mark = np.frombuffer(seed.to_bytes(8, "little") + i.to_bytes(8, "little"), dtype=np.uint8)
    flat = rgb.reshape(-1)
    flat[:min(len(mark), flat.size)] = mark[:flat.size]
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _video_data_url(seed: int, i: int, width: int, height: int, seconds: float) -> str:
    import os
    import tempfile

    import cv2
    import numpy as np

    # Colour ramps drifting a few pixels a frame (small files, as camera video compresses), the seed
    # and request number in the first pixels of each frame.
    y, x = np.mgrid[0:height, 0:width]
    mark = np.frombuffer(seed.to_bytes(8, "little") + i.to_bytes(8, "little"), dtype=np.uint8)
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 2.0, (width, height))
        for f in range(max(1, round(seconds * 2))):
            bgr = np.stack([(x + 3 * f + 7 * i) % 256, (y + 2 * f + 13 * i) % 256, (x + y + 29 * i) % 256],
                           axis=-1).astype(np.uint8)
            flat = bgr.reshape(-1)
            flat[:min(len(mark), flat.size)] = mark[:flat.size]
            writer.write(bgr)
        writer.release()
        with open(path, "rb") as fh:
            return "data:video/mp4;base64," + base64.b64encode(fh.read()).decode()
    finally:
        os.unlink(path)


def _tone_wav_b64(seed: int, i: int, seconds: float, rate: int = 16000) -> str:
    import io
    import wave

    import numpy as np

    # A tone of 200-1000 Hz under quiet noise, both drawn from (seed, i).
    rng = np.random.default_rng([seed, i])
    t = np.arange(max(1, int(seconds * rate))) / rate
    wav = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 1000) * t) + 0.01 * rng.standard_normal(t.size)
    pcm = (wav * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def _tone_pcm_b64(seed: int, i: int, seconds: float) -> str:
    """The same kind of clip as the chats' WAV, as the Realtime API takes audio: 24 kHz PCM16, base64."""
    import io
    import wave

    with wave.open(io.BytesIO(base64.b64decode(_tone_wav_b64(seed, i, seconds, rate=24000)))) as w:
        return base64.b64encode(w.readframes(w.getnframes())).decode()


def arrivals(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """Seconds from a level's start at which each of its n requests is sent: 0 for all without a
    rate, else a Poisson process's (the first at 0)."""
    if not rate:
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _pct(values: list[float], q: float) -> float | None:
    """The q-th percentile, interpolated between the two nearest values (numpy's default: the p50
    of an even count is the mean of the middle two)."""
    if not values:
        return None
    ordered = sorted(values)
    x = q / 100 * (len(ordered) - 1)
    lo = min(int(x), len(ordered) - 1)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)


class _BadStatus(Exception):
    pass


class _Cut(Exception):
    """The stream ended before its end marker: the reply is incomplete."""


async def _events(client: httpx.AsyncClient, path: str, body: dict, done_marker: bool) -> AsyncIterator[dict]:
    """The JSON events of a streamed (SSE) response; a non-200 answer raises _BadStatus, and one
    that ends without `data: [DONE]` (when `done_marker`) raises _Cut."""
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise _BadStatus(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return
            if line.startswith("data: "):
                yield json.loads(line[6:])
    if done_marker:
        raise _Cut("the stream ended without data: [DONE]")


async def _one(client: httpx.AsyncClient, cfg: BenchConfig, i: int, media: list[dict] = ()) -> dict:
    if cfg.speech:
        return await _one_speech(client, cfg, i)
    if cfg.realtime:
        return await _one_realtime(cfg, i, media)
    text = prompt(i, cfg.prompt_words)
    content = [*media, {"type": "text", "text": text}] if media else text
    messages = [{"role": "user", "content": content}]
    if cfg.shared_prefix_words:
        messages.insert(0, {"role": "system", "content": shared_prefix(cfg.shared_prefix_words)})
    body = {"model": cfg.model, "messages": messages,
            "max_tokens": cfg.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    if cfg.audio:
        body["modalities"] = ["text", "audio"]
        body["audio"] = {"format": "wav", **({"voice": cfg.voice} if cfg.voice else {})}
    t0 = time.perf_counter()
    ttft, tokens, error, usage, finished = None, 0, None, {}, False
    audio = _WavStream(t0)
    try:
        async for chunk in _events(client, "/v1/chat/completions", body, done_marker=True):
            if "error" in chunk:
                error = chunk["error"].get("message", "error")
                continue
            deltas = [c.get("delta", {}) for c in chunk.get("choices", [])]
            finished |= any(c.get("finish_reason") for c in chunk.get("choices", []))
            if ttft is None and any(d.get("content") or (d.get("audio") or {}).get("transcript") for d in deltas):
                ttft = time.perf_counter() - t0
            for d in deltas:
                data = (d.get("audio") or {}).get("data")
                if data:
                    audio.add(base64.b64decode(data))
            if chunk.get("usage"):
                usage = chunk["usage"]
                tokens = usage["completion_tokens"]
    except _BadStatus as e:
        return {"error": str(e)}
    except (_Cut, httpx.HTTPError) as e:
        error = f"{type(e).__name__}: {e}"
    if error is None and not (finished and usage):
        error = "the stream had no finish_reason" if not finished else "the stream had no usage chunk"
    if cfg.audio and error is None and not audio.seconds:
        error = "no audio in the response"
    return {**audio.result(ttft, tokens, error), "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def _one_speech(client: httpx.AsyncClient, cfg: BenchConfig, i: int) -> dict:
    body = {"model": cfg.model, "input": prompt(i, cfg.prompt_words), "response_format": "wav",
            "stream_format": "sse", **({"voice": cfg.voice} if cfg.voice else {})}
    tokens, error, done = 0, None, False
    audio = _WavStream(time.perf_counter())
    try:
        async for event in _events(client, "/v1/audio/speech", body, done_marker=False):
            if event.get("type") == "speech.audio.delta":
                audio.add(base64.b64decode(event["audio"]))
            elif event.get("type") == "speech.audio.done":
                tokens, done = event["usage"]["output_tokens"], True
            elif event.get("type") == "error":
                error = (event.get("error") or {}).get("message", "error")
    except _BadStatus as e:
        return {"error": str(e)}
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    if error is None and not (done and audio.seconds):
        error = "no audio in the response" if done else "the stream ended without speech.audio.done"
    return audio.result(None, tokens, error)


async def _one_realtime(cfg: BenchConfig, i: int, media: list[dict]) -> dict:
    from websockets.asyncio.client import connect
    from websockets.exceptions import WebSocketException

    url = cfg.base_url.replace("http", "ws", 1) + f"/v1/realtime?model={cfg.model}"
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    session = {"type": "realtime", "temperature": 0, "max_output_tokens": cfg.max_tokens,
               "output_modalities": ["audio"] if cfg.audio else ["text"],
               "audio": {"input": {"turn_detection": None}}}
    if cfg.shared_prefix_words:
        session["instructions"] = shared_prefix(cfg.shared_prefix_words)
    if cfg.voice:
        session["audio"]["output"] = {"voice": cfg.voice}
    content = [*media, {"type": "input_text", "text": prompt(i, cfg.prompt_words)}]
    audio = _WavStream(time.perf_counter())
    audio.rate = 24000  # (raw PCM16 deltas, no header)
    times: dict = {"ttft": None, "error": None, "done": None, "end": None}
    try:
        async with connect(url, additional_headers=headers, max_size=2**24, open_timeout=cfg.timeout_s) as ws:
            for event in ({"type": "session.update", "session": session},
                          {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                        "content": content}}):
                await ws.send(json.dumps(event))
            await asyncio.wait_for(_realtime_reply(ws, audio, times), cfg.timeout_s)
    except (WebSocketException, OSError, asyncio.TimeoutError) as e:
        times["error"] = f"{type(e).__name__}: {e}"
    ttft, error, done, end = times["ttft"], times["error"], times["done"], times["end"]
    if error is None and done is None:
        error = "the session ended without response.done"
    elif error is None and done["status"] not in ("completed", "incomplete"):
        error = f"response {done['status']}: {done.get('status_details')}"
    if cfg.audio and error is None and not audio.seconds:
        error = "no audio in the response"
    usage = (done or {}).get("usage") or {}
    return {**audio.result(ttft, usage.get("output_tokens", 0), error, end),
            "prompt_tokens": usage.get("input_tokens", 0),
            "cached_tokens": (usage.get("input_token_details") or {}).get("cached_tokens", 0)}


async def _realtime_reply(ws, audio: "_WavStream", out: dict) -> None:
    """A session's events until response.done (or an error), into `out`; response.create is sent
    once the prompt's item is in, the clock restarting there."""
    t0 = None
    async for raw in ws:
        event = json.loads(raw)
        kind = event.get("type")
        if kind == "error":
            out["error"] = (event.get("error") or {}).get("message", "error")
            return
        if kind == "conversation.item.done" and t0 is None:
            t0 = audio.t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "response.create"}))
        elif kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            out["ttft"] = out["ttft"] if out["ttft"] is not None else time.perf_counter() - t0
        elif kind == "response.output_audio.delta":
            audio.add(base64.b64decode(event["delta"]))
        elif kind == "response.done":
            out["done"], out["end"] = event["response"], time.perf_counter()
            return


class _WavStream:
    """One request's 16-bit mono WAV, streamed in pieces (a header, sizes maybe unknown, then
    samples), timed from the request's start `t0`: seconds of audio, time of the first piece, and
    how long a player that starts at the first sample would have paused, waiting for pieces
    (`stall_s`: the sum of the gaps when everything received had played)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.rate, self.sample_bytes = 0, 0
        self.first_s: float | None = None
        self.last_s: float | None = None  # when the last piece with samples came
        self.play_end: float | None = None  # when what arrived so far has finished playing
        self.stall_s = 0.0

    def add(self, data: bytes, t: float | None = None) -> None:
        """A piece that arrived `t` seconds after t0 (default: now)."""
        t = time.perf_counter() - self.t0 if t is None else t
        self.first_s = t if self.first_s is None else self.first_s
        if not self.rate:
            self.rate = int.from_bytes(data[24:28], "little")  # the fmt chunk's sample rate
            data = data[data.index(b"data") + 8:]
        self.sample_bytes += len(data)
        if not data:
            return
        self.last_s = t
        if self.play_end is None:
            self.play_end = t
        elif t > self.play_end:
            self.stall_s += t - self.play_end
            self.play_end = t
        self.play_end += len(data) / 2 / self.rate

    def result(self, ttft: float | None, tokens: int, error: str | None, end: float | None = None) -> dict:
        """`end`: when the request ended (default: now)."""
        return {"ttft_s": ttft, "ttfp_s": self.first_s, "last_packet_s": self.last_s, "audio_s": self.seconds,
                "stall_s": self.stall_s,
                "latency_s": (end or time.perf_counter()) - self.t0, "tokens": tokens, "error": error}

    @property
    def seconds(self) -> float:
        return self.sample_bytes / 2 / self.rate if self.rate else 0.0


async def _level(cfg: BenchConfig, concurrency: int, offset: int, progress, transport=None) -> dict:
    n = cfg.requests_per_level or max(8, 4 * concurrency)
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    sem = asyncio.Semaphore(concurrency)
    done = 0
    limits = httpx.Limits(max_connections=concurrency + 4)
    start = arrivals(n, cfg.request_rate, cfg.arrival_seed)
    media = [media_parts(offset + i, cfg) for i in range(n)]
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=cfg.timeout_s,
                                 limits=limits, transport=transport) as client:
        async def task(i: int) -> dict:
            nonlocal done
            await asyncio.sleep(max(0.0, t0 + start[i] - time.perf_counter()))
            async with sem:
                waited = max(0.0, time.perf_counter() - t0 - start[i])
                try:
                    res = await _one(client, cfg, offset + i, media[i])
                except Exception as e:  # a malformed answer fails its request, not the run
                    res = {"error": f"{type(e).__name__}: {e}"}
            res["queue_wait_s"] = waited
            done += 1
            progress(concurrency, done, n)
            return res

        before = await _stage_counters(client)
        started_at = time.time()  # (Unix time: lines the level up with the stages' OMNI_STEP_LOG)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(task(i) for i in range(n)))
        wall = time.perf_counter() - t0
        stages = _stage_profile(before, await _stage_counters(client), wall)
    ok = [r for r in results if not r.get("error")]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    lat = [r["latency_s"] for r in ok]
    waits = [r["queue_wait_s"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    audio = {}
    if cfg.audio or cfg.speech:
        ttfps = [r["ttfp_s"] for r in ok if r["ttfp_s"] is not None]
        lasts = [r["last_packet_s"] for r in ok if r.get("last_packet_s") is not None]
        rtfs = [r["latency_s"] / r["audio_s"] for r in ok if r["audio_s"]]
        stalls = [r["stall_s"] for r in ok if r["audio_s"]]
        total_audio = sum(r["audio_s"] for r in ok)
        audio = {
            "ttfp_ms": {"p50": ms(_pct(ttfps, 50)), "p90": ms(_pct(ttfps, 90)), "p99": ms(_pct(ttfps, 99))},
            # When the last audio packet came: close to TTFP while the audio is seconds long means
            # it came in a burst (a stage held it back), not as it was generated.
            "last_packet_ms": {"p50": ms(_pct(lasts, 50)), "p90": ms(_pct(lasts, 90))},
            "audio_s": round(total_audio, 2),
            "audio_s_per_wall_s": round(total_audio / wall, 3) if wall > 0 else None,
            "rtf": {"p50": _round(_pct(rtfs, 50)), "p90": _round(_pct(rtfs, 90)),
                    "mean": _round(statistics.fmean(rtfs)) if rtfs else None},
            # Playback pauses of a player starting at the first audio packet, per request.
            "stall_ms": {"p50": ms(_pct(stalls, 50)), "p90": ms(_pct(stalls, 90)),
                         "max": ms(max(stalls)) if stalls else None},
            "stalled_requests": sum(1 for v in stalls if v > 0),
        }
    return {
        "concurrency": concurrency, "requests": n, "request_rate": cfg.request_rate, "errors": n - len(ok),
        "error_examples": sorted({r["error"] for r in results if r.get("error")})[:3],
        "started_at": round(started_at, 3), "wall_s": round(wall, 3), "output_tokens": tokens,
        # (chats: from the usage chunks; cached: what the text stage's prefix cache spared)
        "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in ok),
        "cached_tokens": sum(r.get("cached_tokens", 0) for r in ok),
        "output_tok_s": round(tokens / wall, 1) if wall > 0 else None,
        "ttft_ms": {"p50": ms(_pct(ttfts, 50)), "p90": ms(_pct(ttfts, 90)), "p99": ms(_pct(ttfts, 99)),
                    "mean": ms(statistics.fmean(ttfts)) if ttfts else None},
        "latency_ms": {"p50": ms(_pct(lat, 50)), "p90": ms(_pct(lat, 90)), "p99": ms(_pct(lat, 99))},
        # From a request's scheduled arrival to its send (a concurrency slot free): the other times
        # start at the send, as the server saw the request (vLLM's benchmark times the same way).
        "queue_wait_ms": {"p50": ms(_pct(waits, 50)), "p90": ms(_pct(waits, 90)),
                          "max": ms(max(waits)) if waits else None},
        **audio,
        "stages": stages,
    }


async def _stage_counters(client: httpx.AsyncClient) -> list[dict]:
    """Every stage's counters (`/v1/omni/stages/{i}/stats`, until a 404); [] if the server has none."""
    out = []
    for i in range(64):
        try:
            r = await client.get(f"/v1/omni/stages/{i}/stats")
        except httpx.HTTPError:
            break
        if r.status_code != 200:
            break
        out.append(r.json())
    return out


def _stage_profile(before: list[dict], after: list[dict], wall: float) -> list[dict]:
    """Per stage over one level: steps, mean step time, busy fraction of the wall time, mean batch,
    payload MB sent downstream, backpressure pauses, prompt tokens its prefix cache spared, audio underruns (pieces sent after their
    listener ran dry, and seconds dry: the stage's own view of playback stalls), and the mean time from a request's start to the
    stage's first output for it (`first_output_ms`: which stage holds the first packet back)."""
    rows = []
    for b, a in zip(before, after):
        d = {k: a.get(k, 0) - b.get(k, 0) for k in STAGE_COUNTERS}
        steps = d["steps"]
        rows.append({"stage_id": a["stage_id"], "steps": steps,
                     "step_ms_mean": round(1000 * d["step_s"] / steps, 3) if steps else None,
                     "busy": round(d["step_s"] / wall, 3) if wall > 0 else None,
                     "batch_mean": round(d["batch_sum"] / steps, 2) if steps else None,
                     "payload_mb": round(d["payload_bytes"] / 2**20, 2),
                     "backpressure_pauses": d["backpressure_pauses"],
                     "underruns": d["underruns"], "underrun_s": round(d["underrun_s"], 3),
                     "cached_tokens": d["cached_tokens"],
                     "first_output_ms": round(1000 * d["first_output_s"] / d["first_outputs"], 1)
                     if d["first_outputs"] else None})
    return rows


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _progress(concurrency: int, done: int, total: int) -> None:
    if sys.stderr.isatty():
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\rc={concurrency:<3} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def run_bench(cfg: BenchConfig, progress=_progress, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """`transport`: httpx's (default: the network)."""
    if (cfg.image or cfg.input_audio_s or cfg.video) and cfg.media_seed is None:
        cfg = replace(cfg, media_seed=random.SystemRandom().getrandbits(63))
    levels, offset = [], 0
    for c in cfg.concurrency:
        levels.append(await _level(cfg, c, offset, progress, transport))
        offset += levels[-1]["requests"]
    result = {"config": asdict(cfg), "levels": levels}
    if cfg.reference:
        try:
            ref = await asyncio.to_thread(_reference_level, cfg)
        except Exception as e:  # (the levels measured so far still go out)
            result["reference"] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
            return result
        result["reference"] = ref
        key = "audio_s_per_wall_s" if cfg.audio else "output_tok_s"
        for lv in levels:  # throughput of this level / the reference's, same prompts, same machine
            lv["vs_reference"] = round(lv[key] / ref[key], 3) if lv.get(key) and ref.get(key) else None
    return result


def _reference_level(cfg: BenchConfig) -> dict:
    """transformers' pipeline on this bench's prompts, one request at a time."""
    import torch

    from omni_server.models import reference_for

    device = cfg.reference_device or ("cuda" if torch.cuda.is_available() else "cpu")
    ref = reference_for(cfg.reference)(cfg.reference, device)
    n = cfg.reference_requests
    ref.speak(prompt(0, cfg.prompt_words), cfg.max_tokens, cfg.voice, cfg.reference_talker_max_tokens)  # warm-up
    lat, audio, tokens = [], [], 0
    t0 = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        k, a = ref.speak(prompt(i, cfg.prompt_words), cfg.max_tokens, cfg.voice, cfg.reference_talker_max_tokens,
                         ignore_eos=cfg.ignore_eos)
        lat.append(time.perf_counter() - t)
        audio.append(a)
        tokens += k
    wall, audio_s = time.perf_counter() - t0, sum(audio)
    return {"device": device, "requests": n, "wall_s": round(wall, 3), "output_tokens": tokens,
            "output_tok_s": round(tokens / wall, 1), "audio_s": round(audio_s, 2),
            "audio_s_per_wall_s": round(audio_s / wall, 3) if audio_s else None,
            "latency_ms": {"p50": round(_pct(lat, 50) * 1000, 1) if lat else None},
            "rtf": {"p50": _round(_pct([t / a for t, a in zip(lat, audio) if a], 50))}}
