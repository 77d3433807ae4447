"""Media given as http(s) URLs, fetched by the api when the deployment allows it.

Off unless `server.media_url_domains` lists the hosts to fetch from ("*": any). Fetching from the
server's own network is a request-forgery risk, so every host a fetch reaches (redirects included,
each checked again) must resolve only to public addresses, unless `server.media_url_private` is set
(e.g. an internal media store). Bodies are read up to the request size limit, within a timeout.
The request then goes to the address that was checked (the name kept for the Host header and TLS),
so a name that answers differently the second time (DNS rebinding) cannot redirect it.
"""

from __future__ import annotations

import asyncio
import ipaddress
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

_REDIRECTS = 3


class FetchError(ValueError):
    """A URL the server will not or could not fetch; the message is safe to show to the client."""


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


async def fetch(url: str, *, kind: str, domains: list[str] | None, private: bool, max_bytes: int,
                timeout_s: float) -> bytes:
    """The body of `url` (an image, video or audio file: `kind` names it in errors)."""
    if not domains:
        raise FetchError(f"remote {kind} URLs are not fetched by this server (server.media_url_domains is "
                         f"not set); send the {kind} as a base64 data: URL")
    try:
        async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False) as client:
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
                        raise FetchError(f"{kind} at the URL is larger than the limit of {max_bytes} bytes")
                    body = bytearray()
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        if len(body) > max_bytes:
                            raise FetchError(f"{kind} at the URL is larger than the limit of {max_bytes} bytes")
                    return bytes(body)
            raise FetchError(f"the {kind} URL redirects more than {_REDIRECTS} times")
    except httpx.TimeoutException:
        raise FetchError(f"fetching the {kind} URL timed out after {timeout_s:g} s") from None
    except httpx.HTTPError as e:
        raise FetchError(f"fetching the {kind} URL failed: {type(e).__name__}") from None


def _pinned(url: str, address: str) -> tuple[str, dict]:
    """GET arguments for `url` sent to `address` (an IP of its host): the URL with the address as
    its host, the name in the Host header and as the TLS server name (certificates check it)."""
    parts = urlsplit(url)
    netloc = f"[{address}]" if ":" in address else address
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc)), dict(
        headers={"Host": parts.netloc.rpartition("@")[2]}, extensions={"sni_hostname": parts.hostname})


async def _check(url: str, kind: str, domains: list[str], private: bool) -> str:
    """The address to fetch `url` from: `url` is http(s), its host one of `domains`, and (unless
    `private`) every address it resolves to public."""
    parts = urlsplit(url)
    host = (parts.hostname or "").rstrip(".").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise FetchError(f"{kind} URL must be http(s) with a host")
    if "*" not in domains and not any(host == d or host.endswith("." + d) for d in domains):
        raise FetchError(f"{kind} URLs from {host} are not fetched (server.media_url_domains)")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = await asyncio.get_running_loop().getaddrinfo(host, port)
    except (OSError, ValueError):
        raise FetchError(f"the {kind} URL's host {host} could not be resolved") from None
    addresses = [info[4][0] for info in infos]
    if not private and not all(ipaddress.ip_address(a.split("%")[0]).is_global for a in addresses):
        raise FetchError(f"{kind} URLs that resolve to a non-public address ({host}) are not fetched "
                         "(server.media_url_private)")
    return addresses[0]
