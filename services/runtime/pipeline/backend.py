"""The model API every backend implements: load, warm up, infer a batch.

`infer_batch` returns one result per item, in order; an item that fails is returned
as its exception so that it fails alone. Raising from `infer_batch` fails the whole
batch (the runtime then retries the items one by one to find the bad one).
"""

from __future__ import annotations

from typing import Any

from services.runtime.errors import ApiError


class Backend:
    name = "backend"
    supports_batching = False
    uses_torch = False
    min_image_side = 1  # smaller inputs are refused (422) before they reach the model
    # bytes a model call needs per pixel of its items, at least: a floor for the cost model
    # where the peak cannot be measured (onnxruntime on a GPU); 0: measured only
    memory_per_pixel = 0.0

    def load(self) -> None:
        raise NotImplementedError

    def warmup_items(self) -> list[Any]:
        """Real inputs for warm-up inferences."""
        return []

    def infer_batch(self, items: list[Any]) -> list[Any]:
        raise NotImplementedError

    def item_pixels(self, item: Any) -> int:
        """Pixels of this item as the model sees them: what a call's working memory grows
        with. Default: the size of the item's `rgb` array or `image` (a PIL image or an
        array), else 0 (the item is not a picture)."""
        for name in ("rgb", "image"):
            value = getattr(item, name, None)
            if value is None:
                continue
            shape = getattr(value, "shape", None)
            if shape is not None and len(shape) >= 2:
                return int(shape[0]) * int(shape[1])
            size = getattr(value, "size", None)
            if isinstance(size, tuple) and len(size) == 2:
                return int(size[0]) * int(size[1])
        return 0

    def item_work(self, item: Any) -> float:
        """What this item's share of a call's time grows with, in any unit (the cost model
        compares items with the warm-up's). Default: its pixels, or 1."""
        return float(self.item_pixels(item) or 1)

    def info(self) -> dict[str, Any]:
        return {"backend": self.name}

    def gpu_memory_bytes(self) -> int | None:
        return None

    def on_out_of_memory(self) -> None:
        """Free what can be freed after a GPU out-of-memory error."""

    def progress(self) -> dict[str, Any] | None:
        """The running call's progress, as the model reports it (None: no call, or unknown)."""
        return None


# how torch, onnxruntime (its arena: "Available memory of N is smaller than requested bytes
# of M"), CUDA and cuDNN say that an allocation failed
OUT_OF_MEMORY_MARKS = ("out of memory", "failed to allocate memory", "smaller than requested bytes",
                       "cudaerrormemoryallocation", "cudnn_status_alloc_failed", "cublas_status_alloc_failed")


def is_out_of_memory(exc: BaseException) -> bool:
    import sys
    if isinstance(exc, ApiError):
        # an answer the backend chose (a 4xx naming memory is the client's fault): never a
        # batch cap at warm-up nor a reason to free memory, unless it says out of memory
        return exc.code == "out_of_memory"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())):
        return True
    text = str(exc).lower()
    return any(mark in text for mark in OUT_OF_MEMORY_MARKS)
