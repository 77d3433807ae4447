"""Media given as http(s) URLs, fetched by the api when the deployment allows it.

Off unless `server.media_url_domains` lists the hosts to fetch from ("*": any). Fetching from the
server's own network is a request-forgery risk, so every host a fetch reaches (redirects included,
each checked again) must resolve only to public addresses, unless `server.media_url_private` is set
(e.g. an internal media store); IPv4 addresses inside IPv6 ones (mapped, 6to4, NAT64, Teredo) are
checked too. The request then goes to the address that was checked (the name kept for the Host
header and TLS), so a name that answers differently the second time (DNS rebinding) cannot
redirect it. Bodies are read undecoded up to the request size limit, and the whole fetch (name
lookups, redirects, body) has one deadline. https certificates are checked against the name (the
public CAs, plus `server.media_url_ca_file`'s).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urljoin, urlsplit, urlunsplit

import certifi
import httpx

_REDIRECTS = 3
# Name lookups run on threads of their own: the fetch's timeout ends the request but not a lookup a
# name server never answers, and on the loop's default threads (those of asyncio.to_thread, which
# encode every streamed reply's audio) a few such lookups held up every request.
_RESOLVER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="omni-dns")
# IPv6 prefixes that carry an IPv4 address in their last 32 bits: NAT64's well-known prefix (RFC
# 6052) and IPv4-compatible addresses (deprecated).
_EMBEDDING = [ipaddress.ip_network(n) for n in ("64:ff9b::/96", "::/96")]
# NAT64's local-use prefix (RFC 8215): a network's own translators, which may embed the IPv4
# address at any of several prefix lengths (not only in the last 32 bits): never public.
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")


class FetchError(ValueError):
    """A URL the server will not or could not fetch; the message is safe to show to the client."""


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


@functools.lru_cache(maxsize=4)
def tls_context(ca_file: str | None = None) -> ssl.SSLContext:
    """The TLS settings of every fetch: certifi's CAs, plus those of `ca_file` (PEM). Made once:
    loading the CA bundle takes milliseconds, which a fetch per request should not repeat."""
    context = ssl.create_default_context(cafile=certifi.where())
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as e:
            raise RuntimeError(f"cannot read CA certificates from {ca_file!r}: {e}") from None
    return context


async def fetch(url: str, *, kind: str, domains: list[str] | None, private: bool, max_bytes: int,
                timeout_s: float, ca_file: str | None = None) -> bytes:
    """The body of `url` (an image, video or audio file: `kind` names it in errors); https
    servers' certificates checked against the public CAs and `ca_file`'s."""
    if not domains:
        raise FetchError(f"remote {kind} URLs are not fetched by this server (server.media_url_domains is "
                         f"not set); send the {kind} as a base64 data: URL")
    tls = tls_context(ca_file)  # (a CA file unreadable now is the server's fault: not a FetchError)
    try:
        return await asyncio.wait_for(_get(url, kind, domains, private, max_bytes, tls), timeout_s)
    except asyncio.TimeoutError:
        raise FetchError(f"fetching the {kind} URL took longer than {timeout_s:g} s") from None
    except httpx.HTTPError as e:
        cert = _cause(e, ssl.SSLCertVerificationError)
        if cert is not None:  # (what is wrong with it, e.g. "Hostname mismatch": the client's to fix)
            raise FetchError(f"fetching the {kind} URL failed: its server's TLS certificate was refused "
                             f"({cert.verify_message})") from None
        raise FetchError(f"fetching the {kind} URL failed: {type(e).__name__}") from None
    except (httpx.InvalidURL, ValueError) as e:  # (UnicodeError too: a host IDNA cannot encode)
        if isinstance(e, FetchError):
            raise
        raise FetchError(f"the {kind} URL is not a valid URL") from None


def _cause(e: BaseException, kind: type) -> BaseException | None:
    """The first exception of `kind` among `e` and what caused it."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, kind):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


async def _get(url: str, kind: str, domains: list[str], private: bool, max_bytes: int,
               tls: ssl.SSLContext) -> bytes:
    too_large = FetchError(f"{kind} at the URL is larger than the limit of {max_bytes} bytes")
    # identity: the bytes read are the bytes held (a compressed body could expand far past the cap).
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=None, verify=tls,
                                 headers={"Accept-Encoding": "identity"}) as client:
        for _ in range(_REDIRECTS + 1):
            target, pins = _pinned(url, await _check(url, kind, domains, private))
            async with client.stream("GET", target, **pins) as r:
                if r.is_redirect and "location" in r.headers:
                    url = urljoin(url, r.headers["location"])
                    continue
                if r.status_code != 200:
                    raise FetchError(f"fetching the {kind} URL failed: HTTP {r.status_code}")
                size = r.headers.get("content-length", "")
                if size.isdigit() and int(size) > max_bytes:
                    raise too_large
                body = bytearray()
                async for chunk in r.aiter_raw():
                    body += chunk
                    if len(body) > max_bytes:
                        raise too_large
                return bytes(body)
    raise FetchError(f"the {kind} URL redirects more than {_REDIRECTS} times")


def _pinned(url: str, address: str) -> tuple[str, dict]:
    """GET arguments for `url` sent to `address` (an IP of its host): the URL with the address as
    its host, the name (IDNA-encoded) in the Host header and as the TLS server name (certificates
    are checked against it)."""
    parts = urlsplit(url)
    # (A fully qualified name's trailing dot off: certificates name hosts without it.)
    name = parts.hostname.rstrip(".").encode("idna").decode("ascii")
    address = address.split("%")[0]  # (a link-local scope, only with media_url_private)
    netloc = f"[{address}]" if ":" in address else address
    host = f"[{name}]" if ":" in name else name
    if parts.port:
        netloc, host = f"{netloc}:{parts.port}", f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc)), dict(headers={"Host": host}, extensions={"sni_hostname": name})


async def _check(url: str, kind: str, domains: list[str], private: bool) -> str:
    """The address to fetch `url` from: `url` is http(s), its host one of `domains`, and (unless
    `private`) every address it resolves to public."""
    parts = urlsplit(url)
    host = (parts.hostname or "").rstrip(".").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise FetchError(f"{kind} URL must be http(s) with a host")
    if "*" not in domains and not any(host == d or host.endswith("." + d) for d in domains):
        raise FetchError(f"{kind} URLs from {host} are not fetched (server.media_url_domains)")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().run_in_executor(
            _RESOLVER, functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM))
    except OSError:
        raise FetchError(f"the {kind} URL's host {host} could not be resolved") from None
    addresses = [info[4][0] for info in infos]
    if not private and not all(public(a) for a in addresses):
        raise FetchError(f"{kind} URLs that resolve to a non-public address ({host}) are not fetched "
                         "(server.media_url_private)")
    return addresses[0]


def public(address: str) -> bool:
    """Whether `address` is a public one, and so is any IPv4 address it carries."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6:
        if ip.is_site_local or ip in _LOCAL_NAT64:  # (fec0::/10: deprecated, but routed privately where still used)
            return False
        carried = [ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None]
        carried += [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) for net in _EMBEDDING if ip in net]
        if any(v4 is not None and not v4.is_global for v4 in carried):
            return False
    return ip.is_global
