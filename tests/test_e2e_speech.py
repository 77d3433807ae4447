"""The embedded default pipeline (tiny Qwen2.5-Omni: thinker -> talker -> token2wav) through the real
server and the official openai client, against transformers' own generate() on the same checkpoint:
thinker tokens and talker codes identical, waveform within 1e-3 (float32, greedy, seeded vocoder).

The speech server runs configs/default.yaml with a greedy talker whose codes come back in
`omni_outputs` (see conftest)."""

from __future__ import annotations

import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests import reference
from tests.media import kept_frames, mp4, png, tone_wav, video_with_audio

MODEL = "omni-tiny"
TALKER_MAX_TOKENS = 64  # configs/default.yaml: talker default_sampling.max_tokens
CODEC_STOPS = {8292, 8294}
SAMPLE_RATE = 24000
WAVE_TOL = 1e-3 + 1 / 32768  # the parity bound plus 16-bit quantization of the returned wav


@pytest.fixture(scope="module")
def client(speech_server):
    return openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0)


def _chat(client, text: str, voice: str, seed: int, max_tokens: int = 12, fmt: str = "wav"):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0, seed=seed,
        modalities=["text", "audio"], audio={"voice": voice, "format": fmt},
        extra_body={"return_token_ids": True})


def _wave(b64: str) -> tuple[np.ndarray, int]:
    data, rate = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")
    return data, rate


def _outputs(resp):
    choice = resp.choices[0]
    wave, rate = _wave(choice.message.audio.data)
    return {
        "prompt": resp.model_extra["prompt_token_ids"],
        "thinker": choice.model_extra["token_ids"],
        "talker": resp.model_extra["omni_outputs"]["talker"]["token_ids"],
        "wave": wave, "rate": rate, "transcript": choice.message.audio.transcript,
    }


def _same_codes(ours: list[int], ref: list[int]) -> bool:
    """Ours include the stop token the talker sampled; the reference's are cut before it."""
    return ours[:len(ref)] == ref and (len(ours) == len(ref) or (len(ours) == len(ref) + 1 and ours[-1] in CODEC_STOPS))


def _assert_equals_reference(ours: dict, ref_tokens: list[int], ref_codes: list[int], ref_wave) -> None:
    assert ours["thinker"] == ref_tokens
    assert len(ref_codes) > 0 and _same_codes(ours["talker"], ref_codes), (ours["talker"], ref_codes)
    assert ours["wave"].shape == ref_wave.shape
    assert np.abs(ours["wave"] - ref_wave.clamp(-1, 1).numpy()).max() < WAVE_TOL


@pytest.mark.parametrize("voice,seed", [("Chelsie", 0), ("Ethan", 1234)])
def test_chat_audio_matches_transformers(client, tiny_models, voice, seed):
    resp = _chat(client, "Say something about the sea.", voice, seed)
    ours = _outputs(resp)
    assert resp.choices[0].message.content is None  # OpenAI's shape: the text is the transcript
    assert ours["transcript"] and ours["rate"] == SAMPLE_RATE

    ref_tokens, ref_codes, ref_wave = reference.omni_speech(
        tiny_models["tiny-qwen2_5-omni"], ours["prompt"], 12, TALKER_MAX_TOKENS, voice, seed)
    _assert_equals_reference(ours, ref_tokens, ref_codes, ref_wave)


def test_talker_repetition_penalty_counts_what_transformers_counts(replicas_server, tiny_models):
    """The replicas server's talker draws top-1 with the reference's repetition penalty (1.05)
    through omni-server's sampler (stage/sampling.py): codes equal transformers' greedy ones under
    the same penalty. (The prompt ids the penalty also counts are checked in
    tests/test_qwen2_5_omni_processors.py; on these prompts they do not change the argmax.)"""
    client = openai.OpenAI(base_url=f"{replicas_server.base_url}/v1", api_key="x", max_retries=0)
    for text, voice in [("Say something about the sea.", "Chelsie"), ("Count to three.", "Ethan")]:
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0, seed=0,
            modalities=["text", "audio"], audio={"voice": voice, "format": "pcm16"},
            extra_body={"return_token_ids": True})
        talker = resp.model_extra["omni_outputs"]["talker"]["token_ids"]
        ref_tokens, ref_codes, _ = reference.omni_speech(
            tiny_models["tiny-qwen2_5-omni"], resp.model_extra["prompt_token_ids"], 12, TALKER_MAX_TOKENS, voice, 0,
            talker_repetition_penalty=1.05)
        assert resp.choices[0].model_extra["token_ids"] == ref_tokens
        assert len(ref_codes) > 0 and _same_codes(talker, ref_codes), (talker, ref_codes)


def test_chat_with_audio_input_matches_transformers(client, tiny_models):
    b64, heard = tone_wav()
    content = [{"type": "text", "text": "What do you hear?"},
               {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0, seed=9,
        modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"}, extra_body={"return_token_ids": True})
    ours = _outputs(resp)
    model_dir = tiny_models["tiny-qwen2_5-omni"]
    inputs = reference.omni_inputs(model_dir, [{"role": "user", "content": [
        {"type": "text", "text": "What do you hear?"}, {"type": "audio"}]}], [heard])
    ref_tokens, ref_codes, ref_wave = reference.omni_speech(model_dir, None, 10, TALKER_MAX_TOKENS, "Ethan", 9,
                                                            inputs=inputs)
    _assert_equals_reference(ours, ref_tokens, ref_codes, ref_wave)


def test_chat_with_image_matches_transformers(client, tiny_models):
    url, rgb = png(64, 48)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0,
        modalities=["text"], extra_body={"return_token_ids": True})
    model_dir = tiny_models["tiny-qwen2_5-omni"]
    inputs = reference.omni_inputs(model_dir, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], images=[rgb])
    assert resp.choices[0].model_extra["token_ids"] == reference.thinker_greedy_inputs(model_dir, inputs, 10)
    assert resp.usage.prompt_tokens == inputs["input_ids"].shape[1]  # the image's tokens count
    # Speech too: the talker reads the image prompt's 3-D positions (sent by the thinker stage).
    spoken = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0, seed=5,
        modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"}, extra_body={"return_token_ids": True})
    ours = _outputs(spoken)
    ref_tokens, ref_codes, ref_wave = reference.omni_speech(model_dir, None, 10, TALKER_MAX_TOKENS, "Ethan", 5,
                                                            inputs=inputs)
    _assert_equals_reference(ours, ref_tokens, ref_codes, ref_wave)


def test_chat_with_video_matches_transformers(client, tiny_models):
    """A `video_url` part (vLLM's extension of OpenAI's parts): frames kept at 2 a second (10 frames
    at 4 fps -> 5), prompt, reply, the talker's codes (it reads the video prompt's 3-D positions)
    and the waveform equal transformers' pipeline on the same frames."""
    url, frames = mp4(10, fps=4.0)
    assert frames.shape == (5, 48, 64, 3)
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]
    model_dir = tiny_models["tiny-qwen2_5-omni"]
    inputs = reference.omni_inputs(model_dir, [{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": "What happens?"}]}], videos=[frames])
    spoken = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0, seed=5,
        modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"},
        extra_body={"return_token_ids": True})
    assert spoken.usage.prompt_tokens == inputs["input_ids"].shape[1]  # the video's tokens count
    ref_tokens, ref_codes, ref_wave = reference.omni_speech(model_dir, None, 10, TALKER_MAX_TOKENS, "Chelsie", 5,
                                                            inputs=inputs)
    _assert_equals_reference(_outputs(spoken), ref_tokens, ref_codes, ref_wave)


def test_chat_hearing_a_videos_audio_matches_transformers(client, tiny_models):
    """`use_audio_in_video`: the video's audio track interleaved with its frames (2 s chunks; the
    track outlasts the frames here): the prompt's tokens, reply, the talker's codes (it reads the
    interleaved 3-D positions) and the waveform equal transformers' pipeline given the frames and
    the track the server decodes."""
    from omni_server.api.video import decode_video_audio

    url, _ = video_with_audio(frames=10, fps=4.0, audio_s=3.5, container="mp4")
    data = base64.b64decode(url.split(",", 1)[1])
    frames = kept_frames(url)
    track = decode_video_audio(data, target_rate=16000, max_seconds=60)
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]
    model_dir = tiny_models["tiny-qwen2_5-omni"]
    inputs = reference.omni_inputs(model_dir, [{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": "What happens?"}]}], audios=[track], videos=[frames],
        use_audio_in_video=True)
    spoken = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0, seed=5,
        modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"},
        extra_body={"return_token_ids": True, "mm_processor_kwargs": {"use_audio_in_video": True}})
    assert spoken.usage.prompt_tokens == inputs["input_ids"].shape[1]  # the video's and its track's tokens
    ref_tokens, ref_codes, ref_wave = reference.omni_speech(model_dir, None, 10, TALKER_MAX_TOKENS, "Chelsie", 5,
                                                            inputs={**inputs, "use_audio_in_video": True})
    _assert_equals_reference(_outputs(spoken), ref_tokens, ref_codes, ref_wave)


def test_bad_video_input_is_400(client):
    def ask(url: str):
        content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "Hi"}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2)
        return e.value.message

    assert "not fetched" in ask("https://example.com/v.mp4")
    assert "data:video/" in ask("data:image/png;base64,AAAA")
    assert "not valid base64" in ask("data:video/mp4;base64,%%%")
    assert "could not be decoded" in ask("data:video/mp4;base64," + base64.b64encode(b"not a video" * 50).decode())
    long_url, _ = mp4(260, fps=2.0)  # 130 s at 2 frames a second: server.max_video_frames is 128
    assert "longer than the limit of 128 frames" in ask(long_url)
    url, _ = mp4(2)
    content = [{"type": "video_url", "video_url": {"url": url}}] * 2  # configs/default.yaml: one video per prompt
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert "at most 1 video input(s) per request" in e.value.message


def test_bad_image_input_is_400(client):
    def ask(url: str):
        content = [{"type": "image_url", "image_url": {"url": url}}]
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=2, modalities=["text"])

    with pytest.raises(openai.BadRequestError, match="not fetched"):
        ask("https://example.com/cat.png")
    with pytest.raises(openai.BadRequestError, match="base64"):
        ask("data:image/png;base64,%%%")
    with pytest.raises(openai.BadRequestError, match="decoded"):
        ask("data:image/png;base64," + base64.b64encode(b"not a png").decode())
    big, _ = png(4097, 4097, seed=None)  # server.max_image_pixels defaults to 4096 x 4096
    with pytest.raises(openai.BadRequestError, match="limit"):
        ask(big)
    # The Qwen image processors refuse an aspect ratio over 200: the api refuses it first, saying
    # why (before, the stage's 400 came from vLLM's wrapper of that error).
    thin, _ = png(1, 500, seed=None)
    with pytest.raises(openai.BadRequestError, match="1x500 pixels: its long side may be at most 200 times") as e:
        ask(thin)
    assert e.value.body["message"].startswith("image_url 0: image is 1x500")


def test_bad_audio_input_is_400(client):
    def ask(data: str):
        content = [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=2, modalities=["text"])

    with pytest.raises(openai.BadRequestError, match="input_audio 0"):
        ask("not base64!")
    with pytest.raises(openai.BadRequestError, match="input_audio 0"):
        ask(base64.b64encode(b"RIFF garbage").decode())
    long_b64, _ = tone_wav(seconds=121)  # server.max_audio_seconds defaults to 120
    with pytest.raises(openai.BadRequestError, match="limit"):
        ask(long_b64)


def test_concurrent_requests_equal_each_alone(client):
    cases = [("Tell me a story.", "Chelsie", 1), ("What is two plus two?", "Ethan", 2),
             ("Describe a cat.", "Chelsie", 3), ("Sing.", "Ethan", 4)]
    alone = [_outputs(_chat(client, *c)) for c in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda c: _outputs(_chat(client, *c)), cases))
    for a, b in zip(alone, together):
        assert a["thinker"] == b["thinker"] and a["talker"] == b["talker"]
        assert a["wave"].shape == b["wave"].shape
        assert np.abs(a["wave"] - b["wave"]).max() < WAVE_TOL


def test_next_turn_starts_on_the_prefix_cache_and_still_matches_transformers(client, tiny_models, speech_server):
    """A conversation's second turn shares the first's prompt: the thinker computes only what is new
    (usage counts the cached tokens) and the talker still gets a row for every prompt position, kept
    beside the KV cache (stage/prefix_rows.py), even though the first turn asked for text only and
    fed no talker. Tokens, codes and waveform equal transformers' run of the whole prompt."""
    story = " ".join(["The tide came in over the rocks and the gulls went quiet."] * 12)  # > a 128-token block
    turn = [{"role": "user", "content": story}]
    first = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=6, temperature=0, modalities=["text"])
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And then?"}]
    resp = client.chat.completions.create(
        model=MODEL, messages=turn, max_tokens=10, temperature=0, seed=5, modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"}, extra_body={"return_token_ids": True})
    ours = _outputs(resp)
    assert resp.usage.prompt_tokens_details.cached_tokens >= 128, resp.usage
    assert resp.usage.prompt_tokens == len(ours["prompt"])
    ref_tokens, ref_codes, ref_wave = reference.omni_speech(
        tiny_models["tiny-qwen2_5-omni"], ours["prompt"], 10, TALKER_MAX_TOKENS, "Chelsie", 5)
    _assert_equals_reference(ours, ref_tokens, ref_codes, ref_wave)
    # The same turn again: now the talker's prompt (the thinker's rows, projected) starts on its
    # own prefix cache too, and the reply is the same.
    talker_cached = speech_server.stats(1)["cached_tokens"]
    again = _outputs(client.chat.completions.create(
        model=MODEL, messages=turn, max_tokens=10, temperature=0, seed=5, modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"}, extra_body={"return_token_ids": True}))
    assert speech_server.stats(1)["cached_tokens"] - talker_cached >= 128
    scraped = httpx.get(f"{speech_server.base_url}/metrics").text.splitlines()
    (line,) = [m for m in scraped if m.startswith("omni_stage_prefix_cached_tokens_total{") and 'stage="talker"' in m]
    assert float(line.split()[-1]) == speech_server.stats(1)["cached_tokens"]
    _assert_equals_reference(again, ref_tokens, ref_codes, ref_wave)


def test_cache_salt_reaches_the_talker(client, speech_server):
    """A speech chat's `cache_salt` salts the talker's prefix cache too (its prompt embeddings alone
    would match another tenant's): the same turn under one salt hits in both AR stages, under
    another in neither."""
    story = " ".join(["Rain on the tin roof kept time with the old clock in the hall."] * 12)

    def turn(salt: str) -> tuple[int, int]:
        before = speech_server.stats(1)["cached_tokens"]
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": story}], max_tokens=4, temperature=0, seed=3,
            modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"},
            extra_body={"cache_salt": salt})
        return resp.usage.prompt_tokens_details.cached_tokens, speech_server.stats(1)["cached_tokens"] - before

    assert turn("one") == (0, 0)
    thinker, talker = turn("one")
    assert thinker >= 128 and talker >= 128
    assert turn("two") == (0, 0)
    # /v1/audio/speech takes it too: unsalted first, then salted twice.
    spoken = []
    for salt in (None, "three", "three"):
        before = speech_server.stats(0)["cached_tokens"]
        client.audio.speech.create(model=MODEL, input=story, voice="Chelsie", response_format="pcm",
                                   extra_body={"seed": 1, **({"cache_salt": salt} if salt else {})})
        spoken.append(speech_server.stats(0)["cached_tokens"] - before)
    assert spoken[1] == 0 and spoken[2] >= 128, spoken


def _int16(wave: np.ndarray) -> np.ndarray:
    return np.round(np.clip(wave, -1, 1) * 32767).astype("<i2")


def test_stream_sends_audio_while_the_text_still_streams(client):
    """Chat SSE with audio: transcript deltas and pcm16 data deltas interleave, the first audio
    before the last text (thinker -> talker -> token2wav all streaming), and the concatenated
    pieces are exactly the audio of the same request unstreamed."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Talk for a while."}], max_tokens=1500,
                  temperature=0, seed=5, modalities=["text", "audio"], extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(**kwargs, audio={"voice": "Ethan", "format": "pcm16"}, stream=True,
                                            stream_options={"include_usage": True})
    events, ids, finish, usage = [], set(), None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            audio = choice.delta.audio  # the openai client's ChoiceDeltaAudio
            if audio:
                ids.add(audio.id)
                if audio.transcript:
                    events.append(("text", audio.transcript))
                if audio.data:
                    events.append(("audio", base64.b64decode(audio.data)))
            finish = choice.finish_reason or finish
    kinds = [k for k, _ in events]
    assert finish == "length" and usage.completion_tokens == 1500 and len(ids) == 1
    assert kinds.count("audio") >= 2, "audio arrived in one piece"
    assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("text"), "no audio before the last text"
    whole = client.chat.completions.create(**kwargs, audio={"voice": "Ethan", "format": "wav"})
    wave, rate = _wave(whole.choices[0].message.audio.data)
    assert "".join(v for k, v in events if k == "text") == whole.choices[0].message.audio.transcript
    pcm = np.frombuffer(b"".join(v for k, v in events if k == "audio"), dtype="<i2")
    assert rate == SAMPLE_RATE and len(pcm) > 0
    assert np.array_equal(pcm, _int16(wave))


def test_speech_streams_raw_bytes_and_sse_events(client, speech_server):
    """/v1/audio/speech: the raw body (chunked) and the `stream_format: sse` events carry the same
    samples; SSE sends several speech.audio.delta events, then speech.audio.done with usage."""
    body = {"model": MODEL, "input": "A sentence long enough to take more than one window.", "voice": "Chelsie",
            "response_format": "pcm", "seed": 11}
    with client.audio.speech.with_streaming_response.create(**{k: v for k, v in body.items() if k != "seed"},
                                                            extra_body={"seed": 11}) as r:
        raw = b"".join(r.iter_bytes())
    deltas, done = [], None
    with httpx.stream("POST", f"{speech_server.base_url}/v1/audio/speech", json={**body, "stream_format": "sse"},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "speech.audio.delta":
                    deltas.append(base64.b64decode(event["audio"]))
                else:
                    done = event
    assert done is not None and done["type"] == "speech.audio.done", done
    usage = done["usage"]
    assert len(deltas) >= 2, (len(deltas), usage)
    joined = b"".join(deltas)
    if joined != raw:  # on the H200 (2026-11-30) they differed from byte 41762 of 61440 on
        with client.audio.speech.with_streaming_response.create(**{k: v for k, v in body.items() if k != "seed"},
                                                                extra_body={"seed": 11}) as r:
            again = b"".join(r.iter_bytes())
        pytest.fail(f"raw {_pcm_diff(raw, joined)} vs SSE; the same raw request again: {_pcm_diff(raw, again)}"
                    f"; usage {usage}")
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= TALKER_MAX_TOKENS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def _pcm_diff(a: bytes, b: bytes) -> str:
    """How two pcm16 bodies differ: lengths, samples that differ, where, by how much."""
    if len(a) != len(b) or len(a) % 2:
        return f"{len(a)} bytes, {len(b)} bytes"
    x, y = (np.frombuffer(v, dtype="<i2").astype(np.int32) for v in (a, b))
    where = np.flatnonzero(x != y)
    if not where.size:
        return "equal"
    return (f"{where.size} of {x.size} samples differ (first {where[0]}, last {where[-1]}), "
            f"by at most {int(np.abs(x - y).max())}")


def test_speech_sse_disconnect_clears_every_stage(speech_server):
    body = {"model": MODEL, "input": "Words " * 200, "voice": "Ethan", "response_format": "pcm",
            "stream_format": "sse"}
    with httpx.stream("POST", f"{speech_server.base_url}/v1/audio/speech", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # first audio: leave
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(speech_server.stats(i)["request_ids"] for i in range(3)):
        time.sleep(0.2)
    assert not any(speech_server.stats(i)["request_ids"] for i in range(3))


def test_talker_starts_while_the_thinker_still_talks(client, speech_server):
    """configs/default.yaml streams the thinker's output into the talker (`input_mode: stream`): with a
    long reply, the talker finishes its 64 codec tokens while the thinker is still generating (in
    full mode the talker could not even start before the thinker finished)."""
    import threading

    talker_steps = speech_server.stats(1)["steps"]
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            thinker, talker = speech_server.stats(0), speech_server.stats(1)
            if (thinker["num_running"] == 1 and talker["steps"] >= talker_steps + TALKER_MAX_TOKENS
                    and not talker["request_ids"]):
                seen.append(thinker["steps"])
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Talk for a while."}], max_tokens=1500,
            temperature=0, audio={"voice": "Ethan", "format": "wav"}, extra_body={"ignore_eos": True})
    finally:
        done.set()
        watcher.join()
    assert resp.usage.completion_tokens == 1500 and resp.choices[0].message.audio.data
    assert seen, "the talker did not finish while the thinker was still generating"


def test_thinker_waits_for_a_slow_talker(client, speech_server):
    """Backpressure: the speech server's talker has `stream_window: 4`, so the thinker pauses
    whenever it is 4 tokens ahead of what the talker reported used. That happens at the latest at
    its 4th token: the talker reports only after it has run on the rows that token's chunk brings
    (the talker's reply rows lag the thinker's tokens by two), and the thinker schedules its next
    step before that can come. The talker's window is below its credit chunk (8 steps) and barely
    above that lag: it asks for more whenever it waits for input, so nothing stalls. The thinker runs
    free to its 1500 tokens once the talker is done (64 codes: it says it needs no more). Every
    other speech test runs under the same tight window with results unchanged."""
    before = speech_server.stats(0)["backpressure_pauses"]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Talk for a while."}], max_tokens=1500,
        temperature=0, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
        extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 1500 and resp.choices[0].message.audio.data
    assert speech_server.stats(0)["backpressure_pauses"] > before


def test_disconnect_mid_speech_clears_every_stage(client, speech_server):
    """A client that goes away while the thinker streams into the talker: the request leaves all three
    stages (thinker stops generating), and the pipeline serves the next request."""
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Go on and on."}], max_tokens=1900, temperature=0,
        audio={"voice": "Chelsie", "format": "wav"}, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    request_id = next(chunks).id
    next(chunks)  # the thinker is generating
    assert request_id in speech_server.stats(0)["request_ids"]
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(request_id not in speech_server.stats(i)["request_ids"] for i in range(3)):
            break
        time.sleep(0.2)
    assert all(request_id not in speech_server.stats(i)["request_ids"] for i in range(3))
    assert speech_server.stats(0)["num_running"] == 0  # aborted well before its 1900 tokens
    after = _chat(client, "Hello", "Ethan", 3, max_tokens=4)
    assert after.choices[0].message.audio.data


def test_stop_string_ends_text_and_speech_says_all_before_it(client, speech_server, tiny_models):
    """A stop string cuts the thinker short (FinishRequest): the talker and vocoder speak every token
    before it, as transformers' pipeline speaks a reply that ended there (that reply + end of turn)."""
    messages = [{"role": "user", "content": "Count for me."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=30, temperature=0, seed=5,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens = client.chat.completions.create(**kwargs, modalities=["text"]).choices[0].model_extra["token_ids"]
    tok = reference.tokenizer(tiny_models["tiny-qwen2_5-omni"])
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731 (as the reply reads)
    # The stop string: three tokens' text, first found in the reply where the first of them starts
    # (the thinker runs on past its start while it may still be one: the talker must not speak that).
    k = next(k for k in range(3, len(tokens) - 3) if (piece := text(tokens[k:k + 3])).strip()
             and text(tokens[:k + 3]).find(piece) == len(text(tokens[:k])))
    resp = client.chat.completions.create(**kwargs, stop=[text(tokens[k:k + 3])],
                                          audio={"voice": "Ethan", "format": "wav"})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.audio.transcript == text(tokens[:k])
    ours, rate = _wave(choice.message.audio.data)
    prompt = resp.model_extra["prompt_token_ids"]
    reply = tokens[:k] + [tok.convert_tokens_to_ids("<|im_end|>")]
    ref = reference.omni_speech_of_reply(tiny_models["tiny-qwen2_5-omni"], prompt, reply, TALKER_MAX_TOKENS,
                                         "Ethan", 5)
    assert rate == SAMPLE_RATE and ours.shape == ref.shape
    assert np.abs(ours - ref.clamp(-1, 1).numpy()).max() < WAVE_TOL
    for i in range(3):
        assert resp.id not in speech_server.stats(i)["request_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_one_token_reply_is_spoken(client, speech_server, stream):
    """A reply of one token (max_tokens 1; an answer that is only its end of turn) has no reply row
    of its own for the talker's prompt: the talker starts on the end-of-text row and speaks."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0, seed=3,
                  audio={"voice": "Chelsie", "format": "pcm16"}, extra_body={"return_token_ids": True})
    if stream:
        pcm = b"".join(base64.b64decode(c.choices[0].delta.audio.data)
                       for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices and c.choices[0].delta.audio and c.choices[0].delta.audio.data)
        assert len(pcm) > 0 and len(pcm) % 960 == 0  # whole codes: 480 samples of 16 bits each
        return
    resp = client.chat.completions.create(**kwargs)
    ours = resp.choices[0]
    assert len(ours.model_extra["token_ids"]) == 1 and ours.finish_reason == "length"
    codes = resp.model_extra["omni_outputs"]["talker"]["token_ids"]
    pcm = base64.b64decode(ours.message.audio.data)
    assert 0 < len(codes) <= TALKER_MAX_TOKENS and 0 < len(pcm) and len(pcm) % 960 == 0
    for i in range(3):
        assert resp.id not in speech_server.stats(i)["request_ids"]


def test_audio_alone_still_carries_its_transcript(client):
    """`modalities: ["audio"]` is ["text", "audio"]: the spoken reply comes with its transcript and
    its usage (the text stage's output is what the speech says)."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, seed=1,
                  audio={"voice": "Ethan", "format": "wav"})
    alone = client.chat.completions.create(**kwargs, modalities=["audio"])
    both = client.chat.completions.create(**kwargs, modalities=["text", "audio"])
    assert alone.choices[0].message.audio.transcript == both.choices[0].message.audio.transcript != ""
    assert alone.usage.completion_tokens == both.usage.completion_tokens == 4
    assert alone.choices[0].finish_reason == both.choices[0].finish_reason == "length"


def test_only_the_talker_input_carries_hidden_states(client, speech_server):
    """token2wav reads codes only (`reads_hidden = False`): the talker neither captures nor sends
    hidden states, while the thinker sends the talker its rows (3 stages' payload counters)."""
    thinker, talker = speech_server.stats(0)["payload_bytes"], speech_server.stats(1)["payload_bytes"]
    _chat(client, "Hello", "Ethan", 1, max_tokens=6)
    assert speech_server.stats(0)["payload_bytes"] > thinker
    assert speech_server.stats(1)["payload_bytes"] == talker == 0


def test_text_only_request_skips_talker_and_vocoder(client, speech_server):
    before = [speech_server.stats(i)["steps"] for i in (1, 2)]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          modalities=["text"])
    assert resp.choices[0].message.content and resp.choices[0].message.audio is None
    assert [speech_server.stats(i)["steps"] for i in (1, 2)] == before


def test_stage_stats_time_each_stages_first_output(client, speech_server):
    """Every stage counts the request's first output and the time to it from the request's start:
    the thinker's first token, then the talker's first codes, then token2wav's first audio."""
    keys = ("first_outputs", "first_output_s")
    before = [speech_server.stats(i) for i in range(3)]
    _chat(client, "Count from one to ten.", "Chelsie", seed=3)
    after = [speech_server.stats(i) for i in range(3)]
    counts, secs = ([a[k] - b[k] for a, b in zip(after, before)] for k in keys)
    assert counts == [1, 1, 1]
    assert 0 < secs[0] < secs[1] < secs[2], secs


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "pcm"])
def test_speech_endpoint_returns_24khz_audio(client, fmt):
    r = client.audio.speech.create(model=MODEL, input="Hello there, how are you today?", voice="Ethan",
                                   response_format=fmt, extra_body={"seed": 7})
    data = r.read()
    if fmt == "pcm":
        wave = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768
    else:
        wave, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == SAMPLE_RATE
    assert wave.ndim == 1 and len(wave) > SAMPLE_RATE // 10 and np.abs(wave).max() > 0


def test_speech_is_deterministic_per_seed_and_voice(client):
    def speak(voice, seed):
        return client.audio.speech.create(model=MODEL, input="One two three.", voice=voice, response_format="wav",
                                          extra_body={"seed": seed}).read()

    a = speak("Chelsie", 3)
    assert speak("Chelsie", 3) == a
    assert speak("chelsie", 3) == a  # voice names match in any case
    assert speak("Ethan", 3) != a


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speech_speed_changes_tempo_not_pitch(client, speed):
    """`speed`: the same seed's speech, len / speed samples long, streamed, at the same pitch (its
    spectrum's centre moves by little; a resampled one would move by the speed's factor)."""
    def speak(speed, fmt="pcm"):
        with client.audio.speech.with_streaming_response.create(
                model=MODEL, input="Hello there, how are you today?", voice="Ethan", response_format=fmt,
                speed=speed, extra_body={"seed": 5}) as r:
            return b"".join(r.iter_bytes())

    plain, fast = speak(1.0), speak(speed)
    a = np.frombuffer(plain, "<i2").astype(np.float32) / 32768
    b = np.frombuffer(fast, "<i2").astype(np.float32) / 32768
    assert len(b) == round(len(a) / speed)
    assert speak(speed) == fast  # seeded: the same bytes again

    def centroid(w):
        power = np.abs(np.fft.rfft(w)) ** 2
        return float((np.fft.rfftfreq(len(w), 1 / SAMPLE_RATE) * power).sum() / power.sum())

    assert abs(centroid(b) / centroid(a) - 1) < 0.25, (centroid(a), centroid(b))
    # a format encoded whole (flac) has the same duration
    wave, rate = sf.read(io.BytesIO(speak(speed, "flac")), dtype="float32")
    assert rate == SAMPLE_RATE and len(wave) == len(b)


def test_speech_matches_transformers_speaking_that_reply(client, tiny_models):
    """/v1/audio/speech: the thinker reads the input as its own reply; the audio equals transformers'
    pipeline given that reply (thinker teacher-forced, talker and token2wav unchanged)."""
    text, voice, seed = "The quick brown fox jumps over the lazy dog.", "Chelsie", 21
    wav = client.audio.speech.create(model=MODEL, input=text, voice=voice, response_format="wav",
                                     extra_body={"seed": seed}).read()
    ours, rate = sf.read(io.BytesIO(wav), dtype="float32")
    tok = reference.tokenizer(tiny_models["tiny-qwen2_5-omni"])
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    reply = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    ref = reference.omni_speech_of_reply(tiny_models["tiny-qwen2_5-omni"], list(prompt), reply, TALKER_MAX_TOKENS,
                                         voice, seed)
    assert rate == SAMPLE_RATE and ours.shape == ref.shape
    diff = np.abs(ours - ref.clamp(-1, 1).numpy()).max()
    assert diff < WAVE_TOL, diff


def test_bad_audio_requests_are_400(client, speech_server):
    with pytest.raises(openai.BadRequestError, match="Chelsie, Ethan"):
        _chat(client, "x", "Nobody", 0)
    with pytest.raises(openai.BadRequestError, match="format"):
        _chat(client, "x", "Ethan", 0, fmt="aiff")
    with pytest.raises(openai.BadRequestError, match="Chelsie, Ethan"):
        client.audio.speech.create(model=MODEL, input="x", voice="Nobody")
    with pytest.raises(openai.BadRequestError, match="speed"):  # (OpenAI's range: 0.25-4)
        client.audio.speech.create(model=MODEL, input="x", voice="Ethan", speed=4.5)
    with pytest.raises(openai.BadRequestError, match="seed"):  # (int64: a larger one was a 500)
        client.audio.speech.create(model=MODEL, input="x", voice="Ethan", extra_body={"seed": 2**64})
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="nope", input="x", voice="Ethan")
    with pytest.raises(openai.BadRequestError, match="tokens, the limit") as e:  # (past the tiny context)
        client.audio.speech.create(model=MODEL, input="hello " * 682, voice="Ethan")
    assert e.value.body["param"] == "input"
    r = httpx.get(f"{speech_server.base_url}/v1/audio/voices")
    assert r.json() == {"voices": ["Chelsie", "Ethan"], "default": "Chelsie"}


def test_logprobs_of_a_spoken_reply(client, tiny_models):
    """With audio out, logprobs cover the transcript's tokens (and a stream carries them on its
    transcript chunks); the talker's codes never enter them."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0,
                  modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16"}, logprobs=True,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    resp = client.chat.completions.create(**kwargs)
    content = resp.choices[0].logprobs.content
    assert len(content) == len(resp.choices[0].model_extra["token_ids"]) == 6
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in content)
    tok = reference.tokenizer(tiny_models["tiny-qwen2_5-omni"])
    assert [e.token for e in content] == [tok.decode([t]) for t in resp.choices[0].model_extra["token_ids"]]
    streamed = [e for c in client.chat.completions.create(**kwargs, stream=True)
                for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    # The same tokens; their logprobs to rounding: the second request prefills on the prefix cache
    # (fewer rows, other kernel shapes: 5e-7 apart on CUDA in float32).
    assert [(e.token, e.bytes, e.top_logprobs) for e in streamed] == [(e.token, e.bytes, e.top_logprobs) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], rel=1e-4, abs=1e-5)
