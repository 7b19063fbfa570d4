"""The webui routes that are not model work: progress, interrupt and skip, the settings,
the listings clients discover a server with, and the webui's error shape on every
/sdapi path (unknown ones, 401 and 500 included).

Each documents its 200 body (webui_schemas). Listings answer what applies here and
empty lists where nothing does. Nothing here does CPU work on the event loop: the
settings are parsed, checked and encoded in the CPU pool, and GET /sdapi/v1/options
answers the bytes the store encoded when it last changed.
"""

from __future__ import annotations

import base64
import inspect
import io
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import onecard
from onecard import Error
from services.img2img import webui_schemas as ws
from services.img2img.webui_info import KARRAS, SAMPLERS, WebuiState, _memory, guard, sdapi_error
from services.img2img.webui_json import refuse_lone_surrogates

# the webui's model-free upscalers (Lanczos and Nearest resize; None leaves the picture as it is)
UPSCALERS = [{"name": name, "model_name": None, "model_path": None, "model_url": None, "scale": 4}
             for name in ("None", "Lanczos", "Nearest")]


def _preview_png(preview: Callable) -> str:
    buf = io.BytesIO()
    preview().save(buf, "PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


def _parse_options(body: bytes, state: WebuiState, parse: Callable[[bytes], Any], max_fields: int) -> None:
    """Parse, check and store a settings document (CPU pool)."""
    doc = parse(body)
    if not isinstance(doc, dict):
        raise Error(422, "invalid_parameter", "body: expected a JSON object")
    limit = max(max_fields, state.store.max_keys + 64)
    if len(doc) > limit:
        raise Error(422, "invalid_parameter", f"body: more than {limit} fields")
    refuse_lone_surrogates(doc)
    state.update_options(doc)


def add_control_routes(service: onecard.Service, routes, state: WebuiState, auth: bool) -> None:
    app = service.app
    errors = (401, 500, 503) if auth else (500, 503)
    progress = routes.progress
    cfg = routes.cfg

    def route(path: str, method: str, fn: Callable, summary: str, body: Any, description: str,
              array: bool = False, extra_errors: tuple[int, ...] = ()) -> None:
        app.add_api_route(path, guard(fn), methods=[method], tags=["webui"], summary=summary,
                          responses=ws.responses(body, description, array=array, errors=(*extra_errors, *errors)))

    async def get_progress(request: Request) -> JSONResponse:
        doc, preview = progress.snapshot()
        skip = request.query_params.get("skip_current_image", "false").strip().lower() in ("true", "1", "yes")
        if preview is not None and not skip:
            doc["current_image"] = await service.run_cpu(_preview_png, preview)
        return JSONResponse(doc)

    async def progress_lite() -> JSONResponse:
        return JSONResponse(progress.snapshot()[0])

    async def interrupt() -> JSONResponse:
        progress.interrupt()
        return JSONResponse({})

    async def skip() -> JSONResponse:
        progress.skip()
        return JSONResponse(None)

    async def get_options() -> Response:
        return Response(state.store.encoded, media_type="application/json")

    async def set_options(request: Request) -> JSONResponse:
        body = await service.read_body(request, cfg.max_options_bytes)
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise Error(415, "unsupported_media_type", "send the options as application/json")
        await service.run_cpu(_parse_options, body, state, service.parse_json, cfg.max_fields)
        return JSONResponse(None)

    route("/sdapi/v1/progress", "GET", get_progress, "The running generation (webui shape); current_image unless "
          "skip_current_image=true", ws.ProgressResponse, "progress, state and the preview")
    route("/sdapi/v1/progress-lite", "GET", progress_lite, "Progress without the preview", ws.ProgressResponse,
          "progress and state")
    route("/sdapi/v1/interrupt", "POST", interrupt, "Stop the running generation between steps; its requests "
          "answer with what they have", ws.EMPTY_OBJECT, "an empty object, as the webui answers")
    route("/sdapi/v1/skip", "POST", skip, "End the running batch between steps; the request goes on with its next "
          "batch", ws.NULL, "null, as the webui answers")
    route("/sdapi/v1/options", "GET", get_options, "Settings (webui shape)", ws.Options, "the settings")
    route("/sdapi/v1/options", "POST", set_options, "Change settings (kept for this process; known keys typed, "
          "others bounded in count and size)", ws.NULL, "null, as the webui answers",
          extra_errors=(400, 413, 415, 422))

    async def sd_models():
        return JSONResponse([state.sd_model()])

    async def samplers():
        return JSONResponse([{"name": name, "aliases": aliases, "options": {"scheduler": "karras"} if key in KARRAS
                              else {}} for name, aliases, key in SAMPLERS])

    async def schedulers():
        automatic = {"name": "automatic", "label": "Automatic", "aliases": None, "default_rho": -1,
                     "need_inner_model": False}
        if not state.diffusers:  # nothing samples on the style network: its infotext says no schedule
            return JSONResponse([automatic])
        return JSONResponse([automatic, {"name": "karras", "label": "Karras", "aliases": None, "default_rho": 7.0,
                                         "need_inner_model": False}])

    async def cmd_flags():
        basic = bool(cfg.basic_auth_env or cfg.basic_auth_file)  # the webui's --api-auth is Basic pairs
        return JSONResponse({"api": True, "api_auth": "***" if basic else None, "nowebui": True,
                             "listen": False, "port": None, "ckpt": state.model_file, "no_half": cfg.dtype == "float32",
                             "lowvram": False, "medvram": False, "xformers": False, "skip_torch_cuda_test": True,
                             "onecard_backend": cfg.backend})

    async def memory():
        return JSONResponse(await service.run_cpu(_memory))

    def constant(value: Any) -> Callable:
        async def answer() -> JSONResponse:
            return JSONResponse(value)
        return answer

    route("/sdapi/v1/sd-models", "GET", sd_models, "The loaded model (this unit never switches)", ws.SDModelItem,
          "one model", array=True)
    route("/sdapi/v1/samplers", "GET", samplers, "Sampler names (style backend: all give the same picture)",
          ws.SamplerItem, "the samplers", array=True)
    route("/sdapi/v1/schedulers", "GET", schedulers, "Noise schedules", ws.SchedulerItem, "the schedules",
          array=True)
    route("/sdapi/v1/cmd-flags", "GET", cmd_flags, "Command-line flags (webui shape; secrets redacted)", ws.CmdFlags,
          "the flags")
    route("/sdapi/v1/memory", "GET", memory, "RAM and CUDA memory", ws.MemoryResponse, "memory figures")
    route("/sdapi/v1/embeddings", "GET", constant({"loaded": {}, "skipped": {}}), "Textual inversion embeddings "
          "(none)", ws.EmbeddingsResponse, "no embeddings")
    route("/sdapi/v1/scripts", "GET", constant({"txt2img": [], "img2img": []}), "Scripts (none)", ws.ScriptsList,
          "no scripts")
    route("/sdapi/v1/upscalers", "GET", constant(UPSCALERS), "Upscalers: the model-free ones (None, Lanczos, "
          "Nearest)", ws.UpscalerItem, "the upscalers", array=True)
    for path, what in (("loras", "LoRAs"), ("sd-vae", "VAE files (the model's own is used)"),
                       ("hypernetworks", "Hypernetworks"), ("face-restorers", "Face restorers"),
                       ("realesrgan-models", "Real-ESRGAN models"), ("prompt-styles", "Prompt styles"),
                       ("script-info", "Scripts' arguments"), ("extensions", "Extensions"),
                       ("latent-upscale-modes", "Latent upscale modes")):
        route(f"/sdapi/v1/{path}", "GET", constant([]), f"{what} (none)", {"type": "array", "maxItems": 0},
              "an empty list")
    for path in ("refresh-checkpoints", "refresh-vae", "refresh-loras", "reload-checkpoint", "unload-checkpoint"):
        route(f"/sdapi/v1/{path}", "POST", constant(None), "Accepted; this unit keeps its one model loaded", ws.NULL,
              "null")

    async def ping():
        return JSONResponse({})
    app.add_api_route("/internal/ping", ping, methods=["GET"], tags=["webui"], summary="Liveness for webui clients",
                      responses={200: {"description": "an empty object",
                                       "content": {"application/json": {"schema": ws.EMPTY_OBJECT}}}})
    _not_found_routes(app)
    _server_errors_in_webui_shape(app)


def _not_found_routes(app: FastAPI) -> None:
    """Unknown /sdapi paths answer 404 (405 for a known path and another method) in the webui's shape."""
    from starlette.routing import Match

    async def unknown(request: Request) -> JSONResponse:
        scope = dict(request.scope)
        allowed = set()
        for r in app.routes:
            if r.path.startswith("/sdapi/{"):
                continue
            match, _ = r.matches({**scope, "method": "__none__"})
            if match != Match.NONE:
                allowed |= set(getattr(r, "methods", None) or ())
        if allowed:
            exc = Error(405, "method_not_allowed", "Method Not Allowed", {"Allow": ", ".join(sorted(allowed))})
        else:
            exc = Error(404, "not_found", "Not Found")
        return JSONResponse(sdapi_error(exc), status_code=exc.status, headers=exc.headers)

    app.add_api_route("/sdapi/{rest:path}", unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                      include_in_schema=False)


def _server_errors_in_webui_shape(app: FastAPI) -> None:
    """An unexpected failure on a /sdapi path answers the webui's shape (with `detail`), as
    the webui answers one; the runtime's handler still logs it and gives it its id."""
    previous = app.exception_handlers.get(Exception)
    if previous is None:
        return

    async def handler(request: Request, exc: Exception):
        resp = previous(request, exc)
        if inspect.isawaitable(resp):
            resp = await resp
        if not request.url.path.startswith("/sdapi/"):
            return resp
        try:
            err = json.loads(resp.body)["error"]
            code, message = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            code, message = "internal_error", "unexpected error"
        return JSONResponse(sdapi_error(Error(resp.status_code, code, message)), status_code=resp.status_code)

    app.add_exception_handler(Exception, handler)
