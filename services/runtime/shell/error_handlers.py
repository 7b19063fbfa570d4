"""The handlers that answer every failure in the error envelope: ApiError as it says,
FastAPI's validation errors as 422 invalid_parameter, routing errors (404, 405), and an
unexpected exception as a 500 whose message carries an id that is also in the log."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.runtime.errors import ApiError

log = logging.getLogger("onecard.service")


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
        # uvicorn closes the connection after an app raised, answered or not: say so, so that the
        # client sends its next request on a new one instead of finding this one reset
        return error_response(500, "internal_error", f"unexpected error; quote id {error_id} when reporting it",
                              {"Connection": "close"})
