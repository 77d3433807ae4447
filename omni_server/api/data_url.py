"""Media sent inline as base64 `data:` URLs (http(s) URLs are api/fetch.py's)."""

from __future__ import annotations

import base64
import binascii
import re


def payload(url: str, pattern: re.Pattern, *, kind: str, accepted: str, max_bytes: int,
            error: type[ValueError]) -> bytes:
    """The bytes of `url` if `pattern` matches its `data:...;base64,` head; else `error` with a
    message the client can read (`kind`: "image" / "video"; `accepted`: the URL forms taken)."""
    m = pattern.match(url)
    if m is None:
        raise error(f"{kind}_url must be a {accepted} URL")
    data = url[m.end():]
    if len(data) * 3 // 4 > max_bytes:
        raise error(f"{kind} is larger than the limit of {max_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise error(f"{kind} data is not valid base64") from None
