"""Media by URL through the real server and the openai client: an `image_url` or `audio_url`
(vLLM's extension) fetched over http from a host the config allows gives the same reply as the
same file sent inline; a host it does not list is a 400. (Every refusal of the fetcher:
test_fetch.)"""

from __future__ import annotations

import base64
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from tests.media import png, tone_wav

MODEL = "omni-tiny"
FILES: dict[str, bytes] = {}


class _Files(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = FILES.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=f"{text_server.base_url}/v1", api_key="unused", max_retries=0)


def _reply(client, part: dict) -> list[int]:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}],
        max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    return r.choices[0].model_extra["token_ids"]


def test_an_image_by_url_reads_as_the_same_image_inline(client, files):
    url, _ = png(64, 48)
    FILES["/cat.png"] = base64.b64decode(url.split(",", 1)[1])
    inline = _reply(client, {"type": "image_url", "image_url": {"url": url}})
    assert _reply(client, {"type": "image_url", "image_url": {"url": f"{files}/cat.png"}}) == inline


def test_audio_by_url_reads_as_the_same_input_audio(client, files):
    b64, _ = tone_wav()
    FILES["/tone.wav"] = base64.b64decode(b64)
    inline = _reply(client, {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}})
    assert _reply(client, {"type": "audio_url", "audio_url": {"url": f"{files}/tone.wav"}}) == inline
    assert _reply(client, {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64}"}}) == inline


@pytest.mark.parametrize("part, says", [
    ({"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}, "media_url_domains"),
    ({"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:1/tone.wav"}}, "fetching the audio URL failed"),
    ({"type": "audio_url", "audio_url": {"url": "data:text/plain;base64,aGk="}}, "data:audio/"),
])
def test_media_urls_the_server_cannot_take_are_400(client, part, says):
    with pytest.raises(openai.BadRequestError, match=says):
        _reply(client, part)
