"""Media URLs fetched by the api (omni_server/api/fetch.py) from a real local HTTP server: what is
fetched, and every way a fetch is refused (off, another host, a non-public address, too large,
redirected elsewhere, an error status, too slow)."""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from omni_server.api.fetch import FetchError, fetch, public

BODY = bytes(range(256)) * 40  # 10,240 bytes
GZIPPED = gzip.compress(bytes(1 << 20))


class _Handler(BaseHTTPRequestHandler):
    hosts: list[str] = []  # each request's Host header
    files: dict[str, bytes] = {}  # more paths to serve

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.hosts.append(self.headers.get("Host", ""))
        if self.path in self.files:
            self._send(200, self.files[self.path])
        elif self.path == "/file":
            self._send(200, BODY)
        elif self.path == "/chunked":  # no Content-Length: the size shows only while reading
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(BODY), 1000):
                piece = BODY[i:i + 1000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path.startswith("/to/"):  # a redirect: /to/file -> /file, /to/http://h/x -> http://h/x
            rest = self.path[len("/to/"):]
            self.send_response(302)
            self.send_header("Location", rest if rest.startswith("http") else "/" + rest)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/slow":
            time.sleep(1.5)
            self._send(200, BODY)
        elif self.path == "/drip":  # a byte every 0.1 s: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Length", "50")
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        elif self.path == "/gzip":  # 1 MB of zeros compressed: held as the ~1 KB sent, never expanded
            self._send(200, GZIPPED, {"Content-Encoding": "gzip"})
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    # On the address `localhost` resolves to first (the fetcher connects to the first it resolves).
    family, _, _, _, (LOCALHOST, *_) = socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)[0]
    address_family = family

    def handle_error(self, request, client_address):
        pass  # (a client that gave up mid-body: the deadline tests)


@pytest.fixture(scope="module")
def server():
    server = _Server((_Server.LOCALHOST, 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def base(server):
    host = f"[{_Server.LOCALHOST}]" if ":" in _Server.LOCALHOST else _Server.LOCALHOST
    return f"http://{host}:{server.server_address[1]}"


def _get(url: str, domains=("127.0.0.1", "::1", "localhost"), private: bool = True, max_bytes: int = 1 << 20, timeout_s: float = 5.0):
    return asyncio.run(fetch(url, kind="image", domains=None if domains is None else list(domains),
                             private=private, max_bytes=max_bytes, timeout_s=timeout_s))


def test_fetches_an_allowed_host(base, server):
    assert _get(f"{base}/file") == BODY
    # By name: sent to the address the check resolved, the name in the Host header.
    assert _get(f"http://localhost:{server.server_address[1]}/file") == BODY
    assert _Handler.hosts[-1] == f"localhost:{server.server_address[1]}"
    assert _get(f"{base}/chunked") == BODY
    assert _get(f"{base}/to/file") == BODY  # a redirect on the same host, followed
    assert _get(f"{base}/file", domains=["*"]) == BODY


@pytest.mark.parametrize("path, kw, says", [
    ("/file", dict(domains=None), "not fetched by this server"),
    ("/file", dict(domains=["example.com"]), "are not fetched .server.media_url_domains"),
    ("/file", dict(private=False), "non-public address"),  # the server's own network
    ("/file", dict(domains=["*"], private=False), "non-public address"),
    ("/file", dict(max_bytes=10_000), "larger than the limit of 10000 bytes"),  # by its Content-Length
    ("/chunked", dict(max_bytes=10_000), "larger than the limit"),  # while reading
    ("/nothing", {}, "HTTP 404"),
    ("/loop", {}, "redirects more than 3 times"),
    ("/to/http://example.com/x", {}, "from example.com are not fetched"),  # every hop is checked
    ("/slow", dict(timeout_s=0.3), "took longer than 0.3 s"),
    ("/drip", dict(timeout_s=1.0), "took longer than 1 s"),  # one deadline for the whole fetch
])
def test_refusals(base, path, kw, says):
    with pytest.raises(FetchError, match=says):
        _get(base + path, **kw)


def test_only_http_urls_with_a_host():
    for url in ("ftp://127.0.0.1/x", "http:///x"):
        with pytest.raises(FetchError, match="http"):
            _get(url)
    for url in ("http://[::1/x", "http://127.0.0.1/a\x01b", "http://127.0.0.1/" + "a" * 70000):
        with pytest.raises(FetchError, match="not a valid URL"):  # (not a 500)
            _get(url)


def test_a_compressed_body_is_held_as_sent(base):
    assert _get(f"{base}/gzip", max_bytes=1 << 16) == GZIPPED  # (decoded, it would be 1 MB: refused)


@pytest.mark.parametrize("address, ok", [
    ("93.184.216.34", True), ("2606:2800:220:1:248:1893:25c8:1946", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("169.254.169.254", False), ("::1", False),
    ("fe80::1%eth0", False), ("fc00::1", False), ("fec0::1", False),
    ("::ffff:10.0.0.1", False), ("::ffff:93.184.216.34", True),  # IPv4-mapped
    ("64:ff9b::a00:1", False), ("64:ff9b::5db8:d822", True),  # NAT64 of 10.0.0.1 / a public one
    ("2002:a00:1::", False),  # 6to4 of 10.0.0.1
    # NAT64's local-use prefix: a network's own translator (127.0.0.1 embedded at /48; 8.8.8.8 at /96)
    ("64:ff9b:1:7f00:0:100:808:808", False), ("64:ff9b:1::808:808", False),
    ("::127.0.0.1", False),  # IPv4-compatible
])
def test_public_addresses(address, ok):
    assert public(address) is ok


def test_a_public_host_is_fetched_only_by_name():
    """Domains cover their subdomains, never a look-alike."""
    with pytest.raises(FetchError, match="not fetched"):
        _get("http://evil-example.com/x", domains=["example.com"], private=False)
    with pytest.raises(FetchError, match="not fetched"):
        _get("http://example.com.evil.net/x", domains=["example.com"], private=False)


def test_a_video_by_url_decodes_as_the_same_video_inline(base):
    """The api's part decoder fetches an http video_url and decodes it as the data: URL's frames."""
    import base64

    import numpy as np

    from omni_server.api.media import decode_part
    from omni_server.api.protocol import VideoURLPart
    from omni_server.config.schema import ServerConfig
    from tests.media import mp4

    url, frames = mp4(6)
    _Handler.files["/v.mp4"] = base64.b64decode(url.split(",", 1)[1])
    limits = ServerConfig(media_url_domains=["127.0.0.1", "[::1]", "localhost"], media_url_private=True)
    assert limits.media_url_domains == ["127.0.0.1", "::1", "localhost"]  # (an IPv6 address, bracketed or not)
    part = VideoURLPart(type="video_url", video_url={"url": f"{base}/v.mp4"})
    assert np.array_equal(asyncio.run(decode_part(limits, part)), frames)


# https: a real TLS server on localhost whose certificate a test CA (trustme) signed. The fetcher
# connects to the address it checked, so this shows the certificate is still checked against the name.
@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    import ssl

    import trustme

    ca = trustme.CA()
    ca_file = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    servers = {}
    for name in ("localhost", "media.example"):  # the second: a valid certificate for another name
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(name).configure_cert(context)
        server = _Server((_Server.LOCALHOST, 0), _Handler)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers[name] = server.server_address[1]
    yield str(ca_file), servers
    # (daemon threads: they end with the test process)


def test_https_is_fetched_by_name_with_the_certificate_checked(tls):
    ca_file, ports = tls
    url = f"https://localhost:{ports['localhost']}/file"
    got = asyncio.run(fetch(url, kind="image", domains=["localhost"], private=True, max_bytes=1 << 20,
                            timeout_s=5.0, ca_file=ca_file))
    assert got == BODY
    assert _Handler.hosts[-1] == f"localhost:{ports['localhost']}"
    fqdn = f"https://localhost.:{ports['localhost']}/file"  # (the certificate names the host without the dot)
    assert asyncio.run(fetch(fqdn, kind="image", domains=["localhost"], private=True, max_bytes=1 << 20,
                             timeout_s=5.0, ca_file=ca_file)) == BODY
    # Not signed by a CA the server trusts: refused (certifi's public CAs alone).
    with pytest.raises(FetchError, match="TLS certificate was refused .unable to get local issuer certificate"):
        _get(url)
    # Signed by the trusted CA, but for another name: refused.
    with pytest.raises(FetchError, match="TLS certificate was refused .Hostname mismatch"):
        asyncio.run(fetch(f"https://localhost:{ports['media.example']}/file", kind="image", domains=["localhost"],
                          private=True, max_bytes=1 << 20, timeout_s=5.0, ca_file=ca_file))


def test_a_ca_file_that_cannot_be_read_fails_the_config(tmp_path):
    from pydantic import ValidationError

    from omni_server.config.schema import ServerConfig

    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    for path in (str(bad), str(tmp_path / "missing.pem")):
        with pytest.raises(ValidationError, match="cannot read CA certificates"):
            ServerConfig(media_url_ca_file=path)
    # Gone after the config was read: the server's fault, never a 400 blaming the URL.
    with pytest.raises(RuntimeError, match="cannot read CA certificates"):
        asyncio.run(fetch("https://localhost/x", kind="image", domains=["localhost"], private=True,
                          max_bytes=1 << 20, timeout_s=5.0, ca_file=str(tmp_path / "missing.pem")))


def test_lookups_and_decoding_run_on_threads_of_their_own(base, monkeypatch):
    """A name server that never answers, or a slow decode, ties up only those threads: not the
    loop's default ones (asyncio.to_thread), which encode every streamed reply's audio."""
    import base64

    from omni_server.api import video
    from omni_server.api.media import decode_part
    from omni_server.api.protocol import VideoURLPart
    from omni_server.config.schema import ServerConfig
    from tests.media import mp4

    threads = {}
    lookup, decode = socket.getaddrinfo, video.decode_video

    def recorded(name, fn):
        def call(*args, **kwargs):
            threads[name] = threading.current_thread().name
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(socket, "getaddrinfo", recorded("lookup", lookup))
    monkeypatch.setattr(video, "decode_video", recorded("decode", decode))
    url, frames = mp4(2)
    _Handler.files["/w.mp4"] = base64.b64decode(url.split(",", 1)[1])
    limits = ServerConfig(media_url_domains=["127.0.0.1", "::1", "localhost"], media_url_private=True)
    part = VideoURLPart(type="video_url", video_url={"url": f"{base}/w.mp4"})
    assert asyncio.run(decode_part(limits, part)).shape == frames.shape
    assert threads["lookup"].startswith("omni-dns") and threads["decode"].startswith("omni-media")


def test_a_relative_ca_file_is_read_beside_the_config(tls, tmp_path, monkeypatch):
    """As every other path in a config: relative to its file (from another directory it failed:
    "cannot read CA certificates from 'ca.pem'")."""
    import shutil

    from omni_server.config import load_config

    ca_file, _ = tls
    shutil.copy(ca_file, tmp_path / "ca.pem")
    config = tmp_path / "pipeline.yaml"
    config.write_text("model: m\nstages:\n  - {id: 0, name: a, model: x, output: text}\n"
                      "server: {media_url_ca_file: ca.pem}\n")
    monkeypatch.chdir("/")
    assert load_config(config).server.media_url_ca_file == str(tmp_path / "ca.pem")
