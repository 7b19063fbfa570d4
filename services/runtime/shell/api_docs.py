"""The OpenAPI document with the service's security schemes, and /docs served from assets
inside a wheel (fastapi-offline), so that the docs page works on a unit without internet.

/openapi.json is rendered once, off the event loop, and its bytes served from then on:
FastAPI's own route JSON-encodes the whole document on the loop at every request, and a
hundred clients asking for it at once held the loop (and the probes) for half a second."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response

if TYPE_CHECKING:
    from services.runtime.edge.credentials import Credentials

OPENAPI_PATH = "/openapi.json"   # the app is made without FastAPI's own route (openapi_url=None)
DOCS_ASSETS = {"swagger-ui-bundle.js": "application/javascript", "swagger-ui.css": "text/css"}


def install_openapi(app: FastAPI, credentials: Credentials) -> Callable[[], Awaitable[bytes]]:
    """Security schemes in the schema, and /docs served from assets inside a wheel. Returns
    what renders the document's bytes (once): the shell awaits it as the service starts, so
    that no request pays for building the schema either."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemes: dict[str, Any] = {}
        if credentials.api_key is not None:
            schemes["apiKey"] = {"type": "apiKey", "in": "header", "name": "X-API-Key"}
            schemes["bearer"] = {"type": "http", "scheme": "bearer"}
        if credentials.basic:
            schemes["basic"] = {"type": "http", "scheme": "basic"}
        if schemes:
            schema.setdefault("components", {})["securitySchemes"] = schemes
            schema["security"] = [{name: []} for name in schemes]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    rendered: list[bytes] = []
    rendering = asyncio.Lock()

    def render() -> bytes:  # what FastAPI's own route sent
        return JSONResponse(app.openapi()).body

    async def openapi_bytes() -> bytes:
        if not rendered:
            async with rendering:  # one rendering, however many ask at once
                if not rendered:
                    rendered.append(await asyncio.to_thread(render))
        return rendered[0]

    async def openapi_json(request) -> Response:
        return Response(await openapi_bytes(), media_type="application/json")

    app.add_route(OPENAPI_PATH, openapi_json, include_in_schema=False)  # GET and HEAD, as FastAPI's own

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        if _asset_dir() is None:
            return HTMLResponse("<p>API docs need the fastapi-offline package; the schema is at "
                                "<a href='/openapi.json'>/openapi.json</a></p>", status_code=404)
        return get_swagger_ui_html(openapi_url=OPENAPI_PATH, title=f"{app.title} - API",
                                   swagger_js_url="/docs/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/swagger-ui.css", swagger_favicon_url="")

    for asset, mime in DOCS_ASSETS.items():
        def make(name: str = asset, media: str = mime):
            async def serve_asset() -> Response:
                data = await asyncio.to_thread(_asset, name)
                if data is None:
                    return Response(status_code=404)
                return Response(data, media_type=media, headers={"Cache-Control": "public, max-age=86400"})
            return serve_asset
        app.add_api_route(f"/docs/{asset}", make(), include_in_schema=False, methods=["GET"])
    return openapi_bytes


@lru_cache(maxsize=1)
def _asset_dir() -> str | None:
    try:
        import fastapi_offline
    except ImportError:
        return None
    return os.path.join(os.path.dirname(fastapi_offline.__file__), "static")


@lru_cache(maxsize=len(DOCS_ASSETS))
def _asset(name: str) -> bytes | None:
    """One of a fixed set of files (the name never comes from a request), read once."""
    base = _asset_dir()
    if base is None or name not in DOCS_ASSETS:
        return None
    with open(os.path.join(base, name), "rb") as fh:
        return fh.read()
