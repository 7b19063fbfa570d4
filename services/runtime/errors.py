"""One error shape for every service: {"error": {"code", "message"}}, 4xx for the caller's faults."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("onecard.service")


class ApiError(Exception):
    """An error a client gets in the envelope ``{"error": {"code", "message"}}`` (public as
    ``onecard.Error``).

    Raise it from any hook (decode, encode: the request fails with ``status``), or return it
    in a model call's results for an item that fails alone. 4xx for the caller's faults; 503
    with ``headers={"Retry-After": "1"}`` for "try again".
    """

    STATUSES: dict[int, str]  # what each status means in onecard's answers (set below)

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


class ClientGone(Exception):
    """The client disconnected before its work started; nobody is listening for an answer."""


ERROR_SCHEMA = {
    "title": "Error", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {
        "code": {"type": "string", "description": "stable, machine-readable"},
        "message": {"type": "string", "description": "for people; names the field or limit at fault"}}}},
}


ERROR_STATUSES = {
    400: "the request is malformed (corrupt image, bad JSON, JSON nested too deep)",
    401: "missing or wrong credentials",
    408: "the request did not arrive in time",
    413: "body, image or decode cost over a limit",
    415: "unsupported content type or image format",
    422: "a parameter is invalid (the message names it)",
    431: "request headers too large",
    499: "the client closed the connection before its answer",
    500: "unexpected failure (the message carries an id that is also in the log)",
    503: "overloaded, still loading, or out of GPU memory (Retry-After says when to retry)",
    504: "the request deadline passed",
}


ApiError.STATUSES = ERROR_STATUSES


def error_responses(statuses: tuple[int, ...] | None = None) -> dict[int, dict]:
    """OpenAPI responses for the error envelope."""
    ref = {"application/json": {"schema": ERROR_SCHEMA}}
    return {s: {"description": ERROR_STATUSES[s], "content": ref} for s in (statuses or ERROR_STATUSES)}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def _field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        msg = "; ".join(f"{_field(e['loc'])}: {e['msg']}" for e in errs[:5])
        return error_response(422, "invalid_parameter", msg or f"{_field(first['loc'])}: {first['msg']}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 400: "bad_request"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        error_id = uuid.uuid4().hex[:12]
        log.error("unexpected error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal_error", f"unexpected error; quote id {error_id} when reporting it")
