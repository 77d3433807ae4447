"""OpenAI-shaped errors: every failure the client sees is {"error": {...}} with the right status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# (OpenAI answers an unknown model or route 404 with type invalid_request_error.)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, *, param=None, code=None, type=None) -> dict:
    return {"error": {"message": message, "param": param, "code": code,
                      "type": type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")}}


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, param=exc.param, code=exc.code, type=exc.type),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        # (a body that is not JSON: its location is a character position, no parameter; an error of
        # the whole body may name its parameter in its context)
        param = None if first.get("type") == "json_invalid" else ".".join(loc) or (first.get("ctx") or {}).get("param")
        msg = "; ".join(_located(e) for e in errs[:5])
        return JSONResponse(error_body(400, msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, "internal server error"), status_code=500)


def _located(e: dict) -> str:
    where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
    if not where and (e.get("ctx") or {}).get("param"):
        return _plain(e.get("msg"))  # (the message says where)
    return f"{where or 'body'}: {_plain(e.get('msg'))}"


def _plain(msg) -> str:
    """A validator's message without pydantic's prefix (our validators' words are the message)."""
    msg = str(msg)
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg
