"""Errors a stage reports in a request's place."""


class RequestError(ValueError):
    """An invalid option of the request itself (its voice, say), raised by an input processor or a
    generator: the client's fault (400) even in a stage fed by another, where other input errors
    are the server's (500)."""
