"""The `diffusers` backend: Stable Diffusion from a local directory (fp16 on CUDA).

Compatible items (same size, steps, strength, guidance scale, scheduler, kind) run as
ONE pipeline call with per-item prompts and per-item generators, so a seed gives the
same picture batched or alone (within float tolerance). Between steps the call stops
when every item in it is cancelled (client gone, deadline passed) or the webui's
interrupt/skip asks; an item cancelled alone is computed with the others and dropped.
Text-to-image and inpainting use pipelines built from the already-loaded components:
no second copy of the weights. Items of a request that a webui interrupt ended before
they started are answered None, without a pipeline call; a preview of the first image's
latents is kept as often as the webui's progress options ask.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
from PIL import Image

import onecard
from onecard import Error
from services.img2img.params import PASSTHROUGH, Cancelled, Img2ImgItem
from services.img2img.progress import LatentPreview, Progress
from services.img2img.settings import Img2ImgSettings
from services.img2img.style import fit

DIFFUSERS_SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddim": ("DDIMScheduler", {}), "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}), "dpmpp_2m": ("DPMSolverMultistepScheduler", {}),
    "lms": ("LMSDiscreteScheduler", {}), "pndm": ("PNDMScheduler", {}), "heun": ("HeunDiscreteScheduler", {}),
    "unipc": ("UniPCMultistepScheduler", {}),
    # reached through the webui's sampler names
    "dpmpp_2m_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "dpm2": ("KDPM2DiscreteScheduler", {}), "dpm2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "ddpm": ("DDPMScheduler", {}), "lcm": ("LCMScheduler", {}),
}
DIFFUSERS_SCHEDULERS.update({  # the webui's "Karras" schedule type
    f"{k}_karras": (cls, {**kw, "use_karras_sigmas": True}) for k, (cls, kw) in list(DIFFUSERS_SCHEDULERS.items())
    if k in ("dpmpp_2m", "dpmpp_2m_sde", "euler", "lms", "heun", "dpm2", "dpm2_a", "unipc")})
# webui sampler names -> our scheduler keys
WEBUI_SAMPLERS = {
    "ddim": "ddim", "euler": "euler", "euler a": "euler_a", "dpm++ 2m": "dpmpp_2m", "dpm++ 2m karras": "dpmpp_2m",
    "lms": "lms", "pndm": "pndm", "plms": "pndm", "heun": "heun", "unipc": "unipc",
}


class DiffusersBackend:
    name = "diffusers"
    supports_batching = True
    uses_torch = True
    min_image_side = 8  # one latent pixel
    supports_text_to_image = True

    def __init__(self, settings: Img2ImgSettings, progress: Progress):
        self.settings, self.progress = settings, progress
        self.pipe = None
        self.pipes: dict[str, Any] = {}
        self._schedulers: dict[str, Any] = {}

    def load(self, ctx: onecard.Setup) -> None:
        import torch
        from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline, StableDiffusionPipeline
        s = self.settings
        cuda = s.device in ("auto", "cuda") and torch.cuda.is_available()
        if s.device == "cuda" and not cuda:
            raise RuntimeError("device 'cuda' asked for, but torch sees no CUDA device")
        self.device = "cuda" if cuda else "cpu"
        self.dtype = torch.float16 if (s.dtype == "float16" or (s.dtype == "auto" and cuda)) else torch.float32
        self.memory_fraction = ctx.torch_memory_budget(torch) if cuda else None
        kwargs: dict[str, Any] = {"torch_dtype": self.dtype, "local_files_only": True}
        if not s.safety_checker:
            kwargs.update(safety_checker=None, requires_safety_checker=False)
        pipe = StableDiffusionImg2ImgPipeline.from_pretrained(s.model_path, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(self.device)
        components = self.pipe.components
        self.pipes = {"img2img": self.pipe, "txt2img": StableDiffusionPipeline(**components),
                      "inpaint": StableDiffusionInpaintPipeline(**components)}
        for p in self.pipes.values():
            p.set_progress_bar_config(disable=True)
        self._schedulers["default"] = self.pipe.scheduler

    def _scheduler(self, key: str):
        if key not in self._schedulers:
            import diffusers
            name, kwargs = DIFFUSERS_SCHEDULERS[key]
            self._schedulers[key] = getattr(diffusers, name).from_config(self._schedulers["default"].config, **kwargs)
        return self._schedulers[key]

    def scheduler_key(self, sampler: str | None) -> str:
        if sampler is None:
            return self.settings.scheduler
        if sampler in DIFFUSERS_SCHEDULERS:
            return sampler
        return WEBUI_SAMPLERS.get(sampler.strip().lower(), self.settings.scheduler)

    # ---- CPU pool ---------------------------------------------------------------------
    def prepare(self, item: Img2ImgItem) -> None:
        if item.image is not None:
            item.image = fit(item.image.convert("RGB"), self.settings.max_side, 8)
        if item.size is not None:
            size = (max(8, item.size[0] // 8 * 8), max(8, item.size[1] // 8 * 8))
            if item.image is not None and item.image.size != size:
                item.image = item.image.resize(size, Image.LANCZOS)
        else:
            size = item.image.size
        if item.mask is not None:
            item.mask = item.mask.resize(size, Image.LANCZOS)
        kind = "txt2img" if item.image is None else ("inpaint" if item.mask is not None else "img2img")
        if kind != "txt2img" and int(item.steps * item.strength) < 1:
            kind = "identity"  # not one denoising step runs (diffusers would fail on an empty schedule)
        item.sampler = self.scheduler_key(item.sampler)
        item.key = (kind, size, item.steps, round(item.strength, 6), round(item.guidance_scale, 6), item.sampler)

    def postprocess(self, item: Img2ImgItem, out: np.ndarray) -> np.ndarray:
        return out

    def item_pixels(self, item: Img2ImgItem) -> int:
        size = item.key[1] if item.key else (item.image.size if item.image is not None else item.size or (0, 0))
        return int(size[0]) * int(size[1])

    def item_work(self, item: Img2ImgItem) -> float:
        steps = item.steps if item.image is None else max(1, int(item.steps * item.strength))
        return float(max(1, self.item_pixels(item)) * steps)

    def warmup_items(self) -> list[Any]:
        # The batch-time curve is measured on these. On a GPU a 64x64, 2-step call is kernel
        # launches, whatever the batch; the curve has to be taken where requests run (SD's
        # native 512x512, the default steps), or batches are sized on the wrong shape. On the
        # CPU the small item keeps the start short.
        side, steps, strength = (64, 2, 0.5)
        if getattr(self, "device", "cpu") == "cuda":
            # at least 2 steps: 1 at strength 0.75 is no denoising step (an identity call)
            side, steps, strength = min(self.settings.max_side, 512) // 8 * 8, max(2, self.settings.default_steps), 0.75
        rgb = Image.fromarray(np.full((side, side, 3), 128, dtype=np.uint8))
        item = Img2ImgItem(rgb, "warm-up", "", strength, steps, 7.5, 0, (side, side))
        self.prepare(item)
        return [item]

    # ---- GPU worker -------------------------------------------------------------------
    def infer_batch(self, items: list[Img2ImgItem], call: onecard.Call | None = None) -> list[Any]:
        def cancelled(n: int) -> bool:
            return call is not None and call.cancelled(n)
        return self._infer(items, list(range(len(items))), cancelled)

    def _infer(self, items: list[Img2ImgItem], where: list[int], cancelled) -> list[Any]:
        """One pipeline call; ``where`` is each item's place in the model call (for ``cancelled``)."""
        if items and items[0].key == PASSTHROUGH:
            return [None] * len(items)
        import torch
        first = items[0]
        kind, size = first.key[0], first.key[1]
        if kind == "identity":
            return [np.asarray(i.image) for i in items]
        # a webui interrupt ended the request these belong to: what had not started is not generated
        run = [(i, w) for i, w in zip(items, where, strict=True) if not self.progress.stopped(i.job)]
        if len(run) < len(items):
            outs = self._infer([i for i, _ in run], [w for _, w in run], cancelled) if run else []
            done = dict(zip((id(i) for i, _ in run), outs, strict=False))
            return [done.get(id(i)) for i in items]
        scheduler = self._scheduler(first.sampler or self.settings.scheduler)
        pipe = self.pipes[kind]
        pipe.scheduler = scheduler  # per call: calls are serialized on this thread
        limit = int(scheduler.config.get("num_train_timesteps", 1000)) - 1
        if first.steps > limit:
            raise Error(422, "invalid_parameter", f"steps: at most {limit} for this model's scheduler")
        total = first.steps if kind == "txt2img" else max(1, int(first.steps * first.strength))
        w, h = size
        self.progress.begin([i.job for i in items], total, textinfo=f"{kind}: {len(items)} image(s) at {w}x{h}")

        def on_step(p, step, timestep, kwargs):
            preview = None
            if self.progress.wants_preview(step + 1) and kwargs.get("latents") is not None:
                preview = LatentPreview(kwargs["latents"][:1].detach().clone(), size)
            self.progress.advance(step + 1, preview, getattr(p, "_num_timesteps", None))
            if self.progress.should_stop() or all(cancelled(w) for w in where):
                p._interrupt = True
            return kwargs

        negatives = [i.negative_prompt for i in items]
        call: dict[str, Any] = dict(
            prompt=[i.prompt for i in items], negative_prompt=negatives if any(negatives) else None,
            num_inference_steps=first.steps, guidance_scale=first.guidance_scale,
            generator=[torch.Generator(device="cpu").manual_seed(i.seed) for i in items],
            output_type="np", callback_on_step_end=on_step)
        if kind == "txt2img":
            call.update(width=size[0], height=size[1])
        else:
            call.update(image=[i.image for i in items], strength=first.strength)
        if kind == "inpaint":
            call.update(mask_image=[i.mask for i in items], width=size[0], height=size[1])
        try:
            out = pipe(**call)
        finally:
            self.progress.end()
        results: list[Any] = []
        for n, w in enumerate(where):
            if cancelled(w):
                results.append(Cancelled())
            else:
                results.append((np.clip(out.images[n], 0, 1) * 255 + 0.5).astype(np.uint8))
        return results

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
        import os
        return {"backend": self.name, "model": self.settings.model_path,
                "model_name": os.path.basename(str(self.settings.model_path).rstrip("/")),
                "device": getattr(self, "device", None),
                "dtype": str(getattr(self, "dtype", "")).replace("torch.", ""),
                "scheduler": type(self._scheduler(self.settings.scheduler)).__name__ if self.pipe else None,
                "safety_checker": self.settings.safety_checker,
                "gpu_memory_fraction": getattr(self, "memory_fraction", None)}
