"""``GET /healthz`` answered ahead of the framework.

The probe is the one request that must stay prompt while the service is busiest. Through
FastAPI it crossed a dozen middleware layers, the router and the dependency solver: about
300 us of the event loop each time, and on a loop sharing the GIL with busy decoders every
such stretch is one more chance to wait for the GIL. The answer is the same document, with
the same headers (the instance header included), as the route's; any other method or path
goes on to the app. It stands in front only of an app whose middleware is the shell's own
(``answering_ahead``): middleware a service adds (CORS for a dashboard in a browser, say)
must see /healthz as it saw it through the route.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

if TYPE_CHECKING:
    from services.runtime.shell.app import ServiceShell

PATH = "/healthz"


def answering_ahead(app, shell: ServiceShell):
    """``app`` behind HealthAnswer, or ``app`` itself when it carries middleware that is not
    the shell's: that middleware may change the answer (add headers), and only the route
    passes through it."""
    if any(all(m is not own for own in shell.own_middleware) for m in getattr(app, "user_middleware", ())):
        return app
    return HealthAnswer(app, shell)


class HealthAnswer:
    def __init__(self, app, shell: ServiceShell):
        self.app, self.shell = app, shell
        self.instance = shell.instance.encode("latin-1") if shell.instance else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        try:
            status, doc = self.shell.health()
            answer = JSONResponse(doc, status_code=status)  # the route's own answer, rendered the same way
        except Exception:  # noqa: BLE001 - the route fails the same way and answers it in the envelope
            return await self.app(scope, receive, send)
        if self.instance is not None:  # where ShellMiddleware puts it on the route's answer
            answer.raw_headers.append((b"x-onecard-instance", self.instance))
        await answer(scope, receive, send)


def health_at_the_door(shell: ServiceShell):
    """For the edge (services.runtime.edge.protocol): the whole HTTP answer to a ``GET /healthz``
    from a newcomer refused because every connection is taken, or None for any other
    request. The same document as the route's, and the connection closes after it: a probe
    needs no place and no app, so clients holding every place (and the overflow) cannot
    turn the probes away."""
    token = shell.instance or ""
    # as uvicorn does for the route's headers: no line breaks in a value
    instance = b"x-onecard-instance: " + token.encode("latin-1") + b"\r\n" \
        if token and not any(c in token for c in "\r\n\0") else b""

    def answer(request: bytes) -> bytes | None:
        line = request[:request.find(b"\r\n")].split(b" ")
        if len(line) != 3 or line[0] != b"GET" or line[1] != PATH.encode() or line[2] not in (b"HTTP/1.1",
                                                                                              b"HTTP/1.0"):
            return None
        try:
            shell.heartbeat.beat()  # answered on the event loop: it is turning
            status, doc = shell.health()
            body = JSONResponse(doc, status_code=status).body
        except Exception:  # noqa: BLE001 - the route answers it in the envelope; here it is refused as any other
            return None
        return (STATUS_LINE[status] + b"content-type: application/json\r\ncontent-length: "
                + str(len(body)).encode() + b"\r\nconnection: close\r\n" + instance + b"\r\n" + body)
    return answer
