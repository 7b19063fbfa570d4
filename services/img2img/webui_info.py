"""What the webui API says about itself: options, listings, the info document.

Options are kept per process (POST /sdapi/v1/options stores any key, as clients expect
to set keys this service does not use). Listings report what applies: the one loaded
model, the samplers this backend maps, and empty lists for upscalers, LoRAs and the rest.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.img2img.params import parse_style
from services.runtime.errors import ApiError

SAMPLERS = [("Euler a", "euler_a"), ("Euler", "euler"), ("LMS", "lms"), ("Heun", "heun"), ("DPM++ 2M", "dpmpp_2m"),
            ("DDIM", "ddim"), ("PLMS", "pndm"), ("UniPC", "unipc")]
SCHEDULERS = [("automatic", "Automatic"), ("uniform", "Uniform"), ("karras", "Karras")]


class WebuiState:
    def __init__(self, routes):
        self.routes = routes
        cfg = routes.cfg
        self.model_title = self._model_title()
        self.options: dict[str, Any] = {
            "sd_model_checkpoint": self.model_title,
            "sd_checkpoint_hash": None,
            "sd_vae": "Automatic",
            "CLIP_stop_at_last_layers": 1,
            "samples_format": "png",
            "sampler_name": None,
            "img2img_fix_steps": False,
            "enable_pnginfo": True,
            "live_previews_enable": True,
            "show_progress_every_n_steps": 1,
            "onecard_backend": cfg.backend,
            "onecard_style": 0,
        }

    def _model_title(self) -> str:
        cfg = self.routes.cfg
        if cfg.backend == "diffusers":
            return os.path.basename(str(cfg.model_path).rstrip("/"))
        return "multistyle26"

    def update_options(self, doc: dict[str, Any]) -> None:
        if "onecard_style" in doc:
            try:
                parse_style(doc["onecard_style"])
            except ValueError as exc:
                raise ApiError(422, "invalid_parameter", f"onecard_style: {exc}") from None
        wanted = doc.get("sd_model_checkpoint")
        if wanted is not None and wanted != self.model_title and wanted.split(" [")[0] != self.model_title:
            raise ApiError(422, "invalid_parameter",
                           f"sd_model_checkpoint: this unit serves {self.model_title!r} and never switches models")
        self.options.update(doc)

    def style_weights(self, req) -> np.ndarray:
        """Style backend: a body field `style`, else the `onecard_style` option (0)."""
        spec = (req.model_extra or {}).get("style", self.options.get("onecard_style", 0))
        try:
            return parse_style(spec)
        except ValueError as exc:
            raise ApiError(422, "invalid_parameter", f"style: {exc}") from None

    def sd_model(self) -> dict[str, Any]:
        cfg = self.routes.cfg
        return {"title": self.model_title, "model_name": self.model_title, "hash": None, "sha256": None,
                "filename": str(cfg.model_path or self.model_title), "config": None}


def info_document(st: dict[str, Any], req, state: WebuiState, routes, n: int) -> dict[str, Any]:
    prompt, negative = req.prompt or "", req.negative_prompt or ""
    seeds = st["seeds"]
    infotexts = [f"{prompt}\nNegative prompt: {negative}\nSteps: {st['steps']}, Sampler: {st['sampler']}, "
                 f"CFG scale: {req.cfg_scale}, Seed: {s}, Size: {st['width']}x{st['height']}, "
                 f"Model: {state.model_title}"
                 + (f", Denoising strength: {st['strength']}" if st["strength"] is not None else "")
                 for s in seeds]
    return {
        "prompt": prompt, "all_prompts": [prompt] * n,
        "negative_prompt": negative, "all_negative_prompts": [negative] * n,
        "seed": seeds[0], "all_seeds": seeds, "subseed": seeds[0], "all_subseeds": seeds,
        "subseed_strength": 0, "width": st["width"], "height": st["height"],
        "sampler_name": st["sampler"], "cfg_scale": req.cfg_scale, "steps": st["steps"],
        "batch_size": req.batch_size or 1, "restore_faces": False, "face_restoration_model": None,
        "sd_model_name": state.model_title, "sd_model_hash": None, "sd_vae_name": None, "sd_vae_hash": None,
        "seed_resize_from_w": -1, "seed_resize_from_h": -1, "denoising_strength": st["strength"],
        "extra_generation_params": {}, "index_of_first_image": 0, "infotexts": infotexts,
        "styles": list(req.styles or []), "job_timestamp": time.strftime("%Y%m%d%H%M%S"), "clip_skip": 1,
        "is_using_inpainting_conditioning": False, "version": "onecard", "backend": routes.cfg.backend,
    }


def _memory() -> dict[str, Any]:
    import psutil
    vm = psutil.virtual_memory()
    ram = {"free": vm.available, "used": vm.total - vm.available, "total": vm.total}
    cuda: dict[str, Any] = {"error": "no CUDA device"}
    try:
        import sys
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            stats = torch.cuda.memory_stats()
            cuda = {"system": {"free": free, "used": total - free, "total": total},
                    "active": {"current": stats.get("active_bytes.all.current", 0),
                               "peak": stats.get("active_bytes.all.peak", 0)},
                    "allocated": {"current": stats.get("allocated_bytes.all.current", 0),
                                  "peak": stats.get("allocated_bytes.all.peak", 0)},
                    "reserved": {"current": stats.get("reserved_bytes.all.current", 0),
                                 "peak": stats.get("reserved_bytes.all.peak", 0)},
                    "inactive": {"current": stats.get("inactive_split_bytes.all.current", 0),
                                 "peak": stats.get("inactive_split_bytes.all.peak", 0)},
                    "events": {"retries": stats.get("num_alloc_retries", 0), "oom": stats.get("num_ooms", 0)}}
    except Exception as exc:  # noqa: BLE001 - a figure, never a failure
        cuda = {"error": str(exc)[:200]}
    return {"ram": ram, "cuda": cuda}


def listing_routes(app: FastAPI, state: WebuiState, ctx) -> None:
    def get(path: str, summary: str):
        return app.get(path, tags=["webui"], summary=summary)

    def post(path: str, summary: str):
        return app.post(path, tags=["webui"], summary=summary)

    @get("/sdapi/v1/sd-models", "The loaded model (this unit never switches)")
    async def sd_models():
        return [state.sd_model()]

    @get("/sdapi/v1/samplers", "Samplers this backend maps")
    async def samplers():
        if state.routes.cfg.backend != "diffusers":
            return [{"name": "Style transfer", "aliases": ["style"], "options": {}}]
        return [{"name": name, "aliases": [key], "options": {}} for name, key in SAMPLERS]

    @get("/sdapi/v1/schedulers", "Noise schedules")
    async def schedulers():
        return [{"name": n, "label": label, "aliases": None, "default_rho": -1, "need_inner_model": False}
                for n, label in SCHEDULERS]

    @get("/sdapi/v1/upscalers", "Upscalers (none here besides plain resizing)")
    async def upscalers():
        return [{"name": "None", "model_name": None, "model_path": None, "model_url": None, "scale": 4},
                {"name": "Lanczos", "model_name": None, "model_path": None, "model_url": None, "scale": 4}]

    @get("/sdapi/v1/latent-upscale-modes", "Latent upscale modes (none)")
    async def latent_modes():
        return []

    @get("/sdapi/v1/embeddings", "Textual inversion embeddings (none)")
    async def embeddings():
        return {"loaded": {}, "skipped": {}}

    for path, summary in (("/sdapi/v1/loras", "LoRAs (none)"), ("/sdapi/v1/sd-vae", "VAEs (the model's own)"),
                          ("/sdapi/v1/hypernetworks", "Hypernetworks (none)"),
                          ("/sdapi/v1/face-restorers", "Face restorers (none)"),
                          ("/sdapi/v1/realesrgan-models", "Real-ESRGAN models (none)"),
                          ("/sdapi/v1/prompt-styles", "Prompt styles (none)"),
                          ("/sdapi/v1/script-info", "Scripts' arguments (none)"),
                          ("/sdapi/v1/extensions", "Extensions (none)")):
        app.add_api_route(path, _empty_list, methods=["GET"], tags=["webui"], summary=summary)

    @get("/sdapi/v1/scripts", "Scripts (none)")
    async def scripts():
        return {"txt2img": [], "img2img": []}

    @get("/sdapi/v1/cmd-flags", "Command-line flags (webui shape)")
    async def cmd_flags():
        return {"api": True, "api_auth": None, "nowebui": True, "listen": False, "port": None,
                "skip_torch_cuda_test": True, "ckpt": state.sd_model()["filename"], "onecard": True}

    @get("/sdapi/v1/memory", "RAM and CUDA memory")
    async def memory():
        return await ctx.cpu.run(_memory)

    for path in ("/sdapi/v1/refresh-checkpoints", "/sdapi/v1/refresh-vae", "/sdapi/v1/refresh-loras",
                 "/sdapi/v1/reload-checkpoint", "/sdapi/v1/unload-checkpoint"):
        app.add_api_route(path, _nothing, methods=["POST"], tags=["webui"],
                          summary="Accepted; this unit keeps its one model loaded")

    @post("/sdapi/v1/interrogate", "Not available here")
    async def interrogate():
        raise ApiError(422, "unsupported", "interrogate is not available on this service")

    for path in ("/sdapi/v1/extra-single-image", "/sdapi/v1/extra-batch-images", "/sdapi/v1/png-info"):
        app.add_api_route(path, _unsupported, methods=["POST"], tags=["webui"], summary="Not available here")

    @app.get("/internal/ping", tags=["webui"], summary="Liveness for webui clients")
    async def ping():
        return {}

    @get("/sdapi/v1/progress-lite", "Progress without the preview")
    async def progress_lite():
        doc, _ = state.routes.progress.snapshot()
        return JSONResponse(doc)


async def _empty_list() -> list:
    return []


async def _nothing() -> None:
    return None


async def _unsupported() -> None:
    raise ApiError(422, "unsupported", "this webui endpoint is not available on this service")
