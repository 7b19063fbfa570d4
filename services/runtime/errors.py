"""One error shape for every service: {"error": {"code", "message"}}, 4xx for the caller's faults.

The errors themselves and their OpenAPI description; the handlers that write them are the
shell's (services.runtime.shell.error_handlers), so that the codecs that raise them stay
free of the web framework."""

from __future__ import annotations

import numbers


class ApiError(Exception):
    """An error a client gets in the envelope ``{"error": {"code", "message"}}`` (public as
    ``onecard.Error``).

    Raise it from any hook (decode, encode: the request fails with ``status``), or return it
    in a model call's results for an item that fails alone. 4xx for the caller's faults; 503
    with ``headers={"Retry-After": "1"}`` for "try again".
    """

    STATUSES: dict[int, str]  # what each status means in onecard's answers (set below)

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        if isinstance(status, bool) or not isinstance(status, numbers.Integral) or not 400 <= status <= 599:
            # a 200 carrying the error envelope read as a success (and made a job "succeeded")
            raise ValueError(f"an error's status is 4xx or 5xx, not {status!r}")
        status = int(status)  # (numpy's integers too)
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
