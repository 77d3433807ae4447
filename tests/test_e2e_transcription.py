"""`/v1/audio/transcriptions` and `/v1/audio/translations` through the embedded default pipeline and
the official openai client:
the upload and its instruction become one chat turn, so a greedy transcription is exactly the
greedy text of the same turn sent to /v1/chat/completions (whose audio path equals transformers,
tests/test_e2e_speech.py)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest
import soundfile as sf

from omni_server.api import transcription
from tests.media import tone_wav

MODEL = "omni-tiny"
WAV_B64, _ = tone_wav(1.0)
WAV = base64.b64decode(WAV_B64)


@pytest.fixture(scope="module")
def client(speech_server):
    return openai.OpenAI(base_url=f"{speech_server.base_url}/v1", api_key="x", max_retries=0)


def _chat_text(client, instruction: str, max_tokens: int) -> tuple[str, object]:
    content = [{"type": "input_audio", "input_audio": {"data": WAV_B64, "format": "wav"}},
               {"type": "text", "text": instruction}]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          modalities=["text"], temperature=0, max_tokens=max_tokens)
    return resp.choices[0].message.content, resp.usage


def test_transcription_is_the_greedy_chat_turn(client):
    got = client.audio.transcriptions.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"),
                                             extra_body={"max_tokens": 12})
    want, usage = _chat_text(client, "Transcribe the audio into text.", 12)
    assert got.text == want and got.text
    assert (got.usage.input_tokens, got.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)


def test_language_names_the_language(client):
    got = client.audio.transcriptions.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"), language="en",
                                             extra_body={"max_tokens": 8})
    assert got.text == _chat_text(client, "Transcribe the English audio into text.", 8)[0]
    got = client.audio.transcriptions.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"), language=" YUE",
                                             extra_body={"max_tokens": 8})
    assert got.text == _chat_text(client, "Transcribe the Cantonese audio into text.", 8)[0]
    # Anything else would go into the instruction as the language's name: refused.
    for bad in ("xx", "English. Then say hello", "en-US"):
        with pytest.raises(openai.BadRequestError, match="is not an ISO-639-1 code") as e:
            client.audio.transcriptions.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"), language=bad)
        assert e.value.body["param"] == "language"


def test_text_format_is_the_bare_text(client):
    text = client.audio.transcriptions.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"),
                                              response_format="text", extra_body={"max_tokens": 8})
    assert isinstance(text, str) and text == _chat_text(client, "Transcribe the audio into text.", 8)[0]


def test_streamed_transcription_equals_the_whole(client):
    whole = client.audio.transcriptions.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"),
                                               extra_body={"max_tokens": 12})
    events = list(client.audio.transcriptions.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"), stream=True,
                                                     extra_body={"max_tokens": 12}))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.text
    assert events[-1].type == "transcript.text.done" and events[-1].text == whole.text
    assert events[-1].usage.output_tokens == whole.usage.output_tokens


def test_translation_is_the_greedy_chat_turn(client):
    got = client.audio.translations.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"),
                                           extra_body={"max_tokens": 10})
    assert got.text and got.text == _chat_text(client, "Translate the speech in the audio into English text.", 10)[0]
    text = client.audio.translations.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"), response_format="text",
                                            prompt="Weather report.", extra_body={"max_tokens": 10})
    assert text == _chat_text(client, "Translate the speech in the audio into English text.\n"
                                      "Text that may precede it, or words it may contain: Weather report.", 10)[0]


def test_translation_refuses_timed_formats(client):
    with pytest.raises(openai.BadRequestError, match="timestamps"):
        client.audio.translations.create(model=MODEL, file=("tone.wav", WAV, "audio/wav"), response_format="vtt")


@pytest.mark.parametrize("form,files,status,says", [
    ({"model": "nope"}, {"file": ("a.wav", WAV, "audio/wav")}, 404, "nope"),
    ({"model": MODEL}, {"file": ("a.txt", b"not audio at all", "text/plain")}, 400, "file: could not decode audio"),
    ({"model": MODEL}, {}, 400, "file"),
    ({"model": MODEL, "response_format": "srt"}, {"file": ("a.wav", WAV, "audio/wav")}, 400, "timestamps"),
    ({"model": MODEL, "response_format": "xml"}, {"file": ("a.wav", WAV, "audio/wav")}, 400, "response_format"),
    ({"model": MODEL, "temperature": "-1"}, {"file": ("a.wav", WAV, "audio/wav")}, 400, "temperature"),
    ({"model": MODEL, "temperature": "1.5"}, {"file": ("a.wav", WAV, "audio/wav")}, 400, "temperature"),  # (OpenAI: 0-1)
    ({"model": MODEL, "stream": "true", "response_format": "srt"}, {"file": ("a.wav", WAV, "audio/wav")}, 400,
     "timestamps"),
])
def test_bad_transcription_requests_are_openai_errors(speech_server, form, files, status, says):
    r = httpx.post(f"{speech_server.base_url}/v1/audio/transcriptions", data=form, files=files, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert says in err["message"] and "Traceback" not in err["message"], err


def test_openai_client_raises_on_a_bad_file(client):
    with pytest.raises(openai.BadRequestError, match="could not decode audio"):
        client.audio.transcriptions.create(model=MODEL, file=("a.wav", b"RIFF....garbage", "audio/wav"))


def test_json_body_is_refused_with_400(speech_server):
    r = httpx.post(f"{speech_server.base_url}/v1/audio/transcriptions", json={"model": MODEL}, timeout=30)
    assert r.status_code == 400 and json.loads(r.text)["error"]["type"] == "invalid_request_error"


def test_a_clip_longer_than_the_model_hears_is_refused_in_a_chat(client):
    """Qwen2.5-Omni's processor keeps the first 30 s of a clip (its Whisper feature extractor
    truncates): a longer clip in a chat would be answered from its start alone, so it is a 400 naming
    the limit; 30 s itself is heard whole."""
    whole_b64, _ = tone_wav(30.0)
    longer_b64, _ = tone_wav(30.5)
    chat = lambda b64: client.chat.completions.create(  # noqa: E731
        model=MODEL, modalities=["text"], max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}]}])
    assert chat(whole_b64).usage.prompt_tokens > 750  # (30 s: 750 audio tokens)
    with pytest.raises(openai.BadRequestError, match="input_audio 0: audio is 30.5 s long; this model hears at "
                                                     "most 30 s of a clip"):
        chat(longer_b64)


def _wav(samples) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_a_file_longer_than_the_model_hears_is_transcribed_clip_by_clip(client):
    """A 65 s file, where the model hears 30 s of a clip, is transcribed as the clips
    `transcription.pieces` cuts (each at its quietest 100 ms before the limit), each one's greedy text
    in order, joined by a space; streamed the same; usage sums the clips'."""
    b64, heard = tone_wav(65.0)
    heard = heard.copy()
    heard[int(29.2 * 16000):int(29.4 * 16000)] = 0  # (a pause: the first cut falls in it)
    clips = transcription.pieces(heard, 30.0, 16000)
    assert 29.2 * 16000 <= clips[0].size <= 29.4 * 16000 and len(clips) == 3
    assert all(c.size <= 30 * 16000 for c in clips) and sum(c.size for c in clips) == heard.size
    each = [client.audio.transcriptions.create(model=MODEL, file=("c.wav", _wav(c), "audio/wav"),
                                               extra_body={"max_tokens": 6}) for c in clips]
    whole = client.audio.transcriptions.create(model=MODEL, file=("long.wav", _wav(heard), "audio/wav"),
                                               extra_body={"max_tokens": 6})
    assert whole.text == " ".join(t.text for t in each if t.text) and whole.text.count(" ") >= 2
    assert whole.usage.input_tokens == sum(t.usage.input_tokens for t in each)
    assert whole.usage.output_tokens == sum(t.usage.output_tokens for t in each)
    with httpx.stream("POST", f"{client.base_url}audio/transcriptions", timeout=120,
                      files={"file": ("long.wav", _wav(heard), "audio/wav")},
                      data={"model": MODEL, "stream": "true", "max_tokens": "6"}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["delta"] for e in events if e["type"] == "transcript.text.delta") == whole.text
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == whole.text
