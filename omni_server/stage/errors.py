"""Errors a stage reports in a request's place."""

import re

# A C++ library's log prefix inside an exception's text (xgrammar's: "[16:36:37] /project/cpp/
# json_schema_converter.cc:5088: "): the build's source path, not the client's business.
_NATIVE_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+\.(?:cc|cpp|cxx|c|h|hpp|cu):\d+: ")


# vLLM's wrapper of a multimodal processor's exception: its text holds the whole input (the prompt,
# every pixel array), its cause says what was wrong.
_PROCESSOR_FAILED = re.compile(r"Failed to apply (\w+) on data=")
# A 400's text at most (what an exception's text can hold is unbounded).
MAX_CLIENT_TEXT = 1000


def client_text(e: BaseException) -> str:
    """An exception's text for a 400 (the client's own input is at fault): one line, without
    native libraries' source locations or the input it echoes, at most MAX_CLIENT_TEXT characters."""
    m = _PROCESSOR_FAILED.match(str(e))
    if m and e.__cause__ is not None:  # (a bare assert's text is empty: its type then)
        return f"{m.group(1)} could not process the media: {client_text(e.__cause__) or type(e.__cause__).__name__}"
    text = " ".join(_NATIVE_PREFIX.sub("", str(e)).split())
    return text if len(text) <= MAX_CLIENT_TEXT else text[:MAX_CLIENT_TEXT - 3] + "..."


def server_fault(what: str, e: BaseException) -> str:
    """A server-side failure as the client reads it: what failed and the exception's type only (its
    text may name internals: paths, tensor shapes, device state); the stage logs the rest."""
    return f"{what} ({type(e).__name__}; the server log has the details)"


class RequestError(ValueError):
    """An invalid option of the request itself (its voice, say), raised by an input processor or a
    generator: the client's fault (400) even in a stage fed by another, where other input errors
    are the server's (500)."""
