"""The model API every backend implements: load, warm up, infer a batch.

`infer_batch` returns one result per item, in order; an item that fails is returned
as its exception so that it fails alone. Raising from `infer_batch` fails the whole
batch (the runtime then retries the items one by one to find the bad one).
"""

from __future__ import annotations

from typing import Any


class Backend:
    name = "backend"
    supports_batching = False
    uses_torch = False
    min_image_side = 1  # smaller inputs are refused (422) before they reach the model

    def load(self) -> None:
        raise NotImplementedError

    def warmup_items(self) -> list[Any]:
        """Real inputs for warm-up inferences."""
        return []

    def infer_batch(self, items: list[Any]) -> list[Any]:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        return {"backend": self.name}

    def gpu_memory_bytes(self) -> int | None:
        return None

    def on_out_of_memory(self) -> None:
        """Free what can be freed after a GPU out-of-memory error."""


def is_out_of_memory(exc: BaseException) -> bool:
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "failed to allocate memory" in text
