"""Errors a stage reports in a request's place."""


def server_fault(what: str, e: BaseException) -> str:
    """A server-side failure as the client reads it: what failed and the exception's type only (its
    text may name internals: paths, tensor shapes, device state); the stage logs the rest."""
    return f"{what} ({type(e).__name__}; the server log has the details)"


class RequestError(ValueError):
    """An invalid option of the request itself (its voice, say), raised by an input processor or a
    generator: the client's fault (400) even in a stage fed by another, where other input errors
    are the server's (500)."""
