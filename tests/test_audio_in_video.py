"""A video's audio track heard with its frames (`mm_processor_kwargs.use_audio_in_video`): decoding
the track, and the requests the api refuses before any stage sees them (real sockets, no engines)."""

from __future__ import annotations

import base64
import contextlib
import io

import numpy as np
import pytest
from fastapi.testclient import TestClient

from omni_server.api.app import ServerState, create_app
from omni_server.api.video import VideoError, decode_video_audio
from omni_server.config import load_config_text
from omni_server.orchestrator.orchestrator import Orchestrator
from omni_server.wire.messages import StageReady
from tests.conftest import MODELS
from tests.media import mp4, tone_wav, video_with_audio


def _bytes(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


@pytest.mark.parametrize("container, rate, channels", [("mp4", 44100, 2), ("webm", 48000, 2), ("mkv", 22050, 1)])
def test_the_track_is_decoded_whole_to_16_khz_mono(container, rate, channels):
    """AAC in MP4, Opus in WebM, FLAC in Matroska: the sine that was encoded, at 16 kHz, its whole
    length (an MP4 track's stated one: not the AAC encoder's padding at the end; WebM states none and
    Opus pads a few ms), whatever the track's rate and channels."""
    url, sent = video_with_audio(container=container, rate=rate, channels=channels, audio_s=1.5, tone_hz=440.0)
    wave = decode_video_audio(_bytes(url), target_rate=16000, max_seconds=60)
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert abs(wave.size - sent.size) <= (1 if container == "mp4" else 0.02 * 16000), (wave.size, sent.size)
    spectrum = np.abs(np.fft.rfft(wave))
    assert abs(np.argmax(spectrum) * 16000 / wave.size - 440.0) < 2.0
    middle = slice(4000, 20000)  # (past the codecs' start-up)
    assert np.sqrt(np.mean(wave[middle] ** 2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.05)


def test_a_track_longer_than_the_frames_is_heard_whole():
    url, sent = video_with_audio(frames=2, fps=4.0, audio_s=3.0, container="mkv", rate=16000, channels=1)
    wave = decode_video_audio(_bytes(url), target_rate=16000, max_seconds=60)
    assert wave.size == sent.size
    np.testing.assert_allclose(wave, sent, atol=2e-4)  # (FLAC: lossless but for 16-bit samples)


def test_tracks_that_cannot_be_heard_are_refused():
    silent, _ = mp4(4)
    with pytest.raises(VideoError, match="no audio track"):
        decode_video_audio(_bytes(silent), target_rate=16000, max_seconds=60)
    url, _ = video_with_audio(audio_s=3.0, container="mkv", rate=16000, channels=1)
    with pytest.raises(VideoError, match=r"audio track is longer than the limit of 2 s"):
        decode_video_audio(_bytes(url), target_rate=16000, max_seconds=2)
    with pytest.raises(VideoError, match="not MP4"):
        decode_video_audio(b"#EXTM3U\n" * 60, target_rate=16000, max_seconds=60)
    data = bytearray(_bytes(url))
    data[200:] = bytes(len(data) - 200)  # (a Matroska header, then nothing decodable)
    with pytest.raises(VideoError):
        decode_video_audio(bytes(data), target_rate=16000, max_seconds=60)


def _track_only(fmt: str, codec: str, rate: int, seconds: float, layout: str = "mono") -> bytes:
    """A container holding one audio track of a 440 Hz sine (no video: all the track reader needs)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        sample_fmt, step = stream.codec_context.format.name, stream.codec_context.frame_size or 1024
        channels = len(stream.codec_context.layout.channels)
        sine = 0.3 * np.sin(2 * np.pi * 440 * np.arange(int(rate * seconds)) / rate)
        for at in range(0, sine.size, step):
            block = np.tile(sine[at:at + step], (channels, 1))
            if not sample_fmt.endswith("p"):  # (packed: channels interleaved)
                block = block.T.reshape(1, -1)
            block = (block * 32767).astype(np.int16) if sample_fmt.startswith("s16") else block.astype(np.float32)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(block), format=sample_fmt, layout=layout)
            frame.sample_rate, frame.pts = rate, at
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def test_only_common_codecs_and_channel_counts_are_decoded():
    """FFmpeg has ~200 audio decoders, many rarely audited: a client's bytes reach those that
    cameras, phones and encoders write, over at most 8 channels (each costs its decoding)."""
    with pytest.raises(VideoError, match="codec adpcm_ms is not read here"):
        decode_video_audio(_track_only("avi", "adpcm_ms", 16000, 1.0), target_rate=16000, max_seconds=60)
    with pytest.raises(VideoError, match="16 channels; the limit is 8"):
        decode_video_audio(_track_only("matroska", "pcm_s16le", 16000, 1.0, "hexadecagonal"), target_rate=16000,
                           max_seconds=60)


def test_a_track_whose_rate_changes_is_heard_at_each_parts_rate():
    """Two AAC pieces in one MPEG-TS, 48 kHz then 16 kHz: the second is converted too (a converter
    made for the first passed it through as if at 48 kHz: sped up 3x, then cut)."""
    data = _track_only("mpegts", "aac", 48000, 2.0) + _track_only("mpegts", "aac", 16000, 2.0)
    wave = decode_video_audio(data, target_rate=16000, max_seconds=60)
    assert abs(wave.size / 16000 - 4.0) < 0.2, wave.size / 16000


CONFIG = """
model: m
stages:
  - {id: 0, name: thinker, model: %s, output: text,
     engine_args: {limit_mm_per_prompt: {image: 1, audio: %d, video: 2}}}
server: {max_audio_seconds: 2}
runtime_dir: %s
"""


@pytest.fixture()
def api(tiny_models, tmp_path):
    """`api(audio_cap, info)`: a client of an api whose stages are not started; `info`: what stage 0
    reported when ready (None: not ready)."""
    with contextlib.ExitStack() as stack:
        def make(audio_cap: int = 2, info: dict | None = None) -> TestClient:
            cfg = load_config_text(CONFIG % (MODELS / "tiny-qwen2_5-omni", audio_cap, tmp_path))
            state = ServerState(cfg, lambda: Orchestrator(cfg, tmp_path))
            client = stack.enter_context(TestClient(create_app(state)))
            if info is not None:
                ready = StageReady(stage_id=0, pid=1, startup_s=1.0, info=info)
                state.orch.stage_info = lambda stage_id: ready if stage_id == 0 else None
            return client

        yield make


def _chat(client, content: list, kwargs) -> tuple[int, dict]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "mm_processor_kwargs": kwargs}
    r = client.post("/v1/chat/completions", json=body)
    return r.status_code, r.json().get("error", {})


def _video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def test_requests_that_cannot_pair_each_video_with_its_track_are_400(api):
    url, _ = video_with_audio(container="mkv", rate=16000, channels=1)
    clip, _ = tone_wav(0.5)
    own_audio = {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}
    client = api(audio_cap=1)
    flag = {"use_audio_in_video": True}
    param = "mm_processor_kwargs.use_audio_in_video"
    status, err = _chat(client, [{"type": "text", "text": "hi"}], flag)
    assert (status, err["param"]) == (400, param) and "needs a video_url part" in err["message"]
    status, err = _chat(client, [_video(url), own_audio], flag)
    assert (status, err["param"]) == (400, param) and "cannot have input_audio parts" in err["message"]
    status, err = _chat(client, [_video(url), _video(url)], flag)  # (audio cap 1: one track)
    assert status == 400 and "at most 1 audio input(s)" in err["message"], err
    assert "each video's audio track is one" in err["message"]
    silent, _ = mp4(4)
    status, err = _chat(client, [_video(silent)], flag)
    assert (status, err["param"]) == (400, "messages") and err["message"] == "video_url 0: video has no audio track"
    long, _ = video_with_audio(container="mkv", rate=16000, channels=1, audio_s=3.0)
    status, err = _chat(client, [_video(long)], flag)  # (server.max_audio_seconds 2)
    assert status == 400 and "longer than the limit of 2 s" in err["message"], err


@pytest.mark.parametrize("kwargs, where", [({"use_audio_in_video": "yes"}, "use_audio_in_video"),
                                          ({"fps": 4}, "fps"), ("on", "mm_processor_kwargs")])
def test_only_use_audio_in_video_is_taken_and_only_as_a_bool(api, kwargs, where):
    """The processor's other arguments are the server's (frame rate, sizes): a client naming one
    learns it is not taken, rather than having it ignored."""
    status, err = _chat(api(), [{"type": "text", "text": "hi"}], kwargs)
    assert status == 400 and where in (err.get("param") or ""), err


def test_a_model_that_cannot_hear_video_audio_says_so(api):
    url, _ = video_with_audio(container="mkv", rate=16000, channels=1)
    status, err = _chat(api(info={}), [_video(url)], {"use_audio_in_video": True})
    assert (status, err["param"]) == (400, "mm_processor_kwargs.use_audio_in_video")
    assert "cannot hear a video's audio track" in err["message"]


def test_a_track_longer_than_the_model_hears_of_a_clip_is_400(api):
    """As an audio part: stage 0's processor would drop the rest of a clip past its `audio_clip_s`."""
    client = api(info={"audio_in_video": "1", "audio_clip_s": "1"})
    url, _ = video_with_audio(container="mkv", rate=16000, channels=1, audio_s=1.5)
    status, err = _chat(client, [_video(url)], {"use_audio_in_video": True})
    assert status == 400 and err["message"].startswith("video_url 0's audio track: audio is 1.5 s long; this model "
                                                       "hears at most 1 s"), err
    exact, _ = video_with_audio(container="mp4", rate=44100, channels=2, audio_s=1.0)  # (AAC: padded past 1 s)
    status, err = _chat(client, [_video(exact)], {"use_audio_in_video": True})
    assert status == 503, err  # (heard whole: on to the stages, which are not running here)
