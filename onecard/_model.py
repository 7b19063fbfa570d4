"""``onecard.Model``: the hooks a model service fills in, and what they are given.

    setup(ctx)                    load, once, on the model's thread (ctx: device, budgets, threads)
    warmup_inputs()               real items: warm-up inferences and the cost curves run on them
    decode_request(request)       CPU pool: one request -> one item (or a list of items)
    predict(items, call)          the model's thread, under the service's FIFO lock: items -> outputs
    encode_response(out, request) CPU pool: an output (a list for a list of items) -> the answer

Items of several requests share one predict() call when ``batching`` is True (up to
``max_batch_size``, only items with equal ``batch_key``). predict() returns one output per
item, in order; an ``onecard.Error`` in its place fails that item's request alone, and an
exception raised fails the call (its items are then retried one by one to find the bad one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, ClassVar

from services.runtime.device import gpu as device_gpu
from services.runtime.device.threads import ort_run_options, ort_session_options
from services.runtime.pipeline.backend import Backend

if TYPE_CHECKING:
    from onecard._request import Request
    from onecard._routes import Service
    from onecard._settings import Settings
    from onecard._types import Params

_default_pixels = Backend.item_pixels


class CallCancelled(Exception):
    """Raised by Call.check(): every item of the call is cancelled; nobody waits for it."""


class Setup:
    """What setup() gets: where the model runs and what it may use.

    ``device`` is "cuda" or "cpu": the ``device`` setting resolved ("auto" is "cuda" when a
    GPU is visible to the service). ``gpu_memory_budget_bytes`` is the share of the card the
    supervisor planned for this service (None: no plan, or no GPU); ``threads`` the CPU
    threads it planned (onnxruntime and torch get them through the helpers below).
    """

    def __init__(self, name: str, settings: Settings, threads: int):
        self.name = name
        self.settings = settings
        self.threads = threads
        self.gpu_memory_budget_bytes = device_gpu.budget_bytes()
        requested = settings.device
        self.device = "cuda" if requested == "cuda" or (requested == "auto" and device_gpu.cuda_expected()) \
            else "cpu"

    def onnx_session(self, model: Any, **kwargs: Any) -> Any:
        """An onnxruntime InferenceSession for a model file or its bytes: the planned threads
        with passive waits, on CUDA (arena capped at the GPU budget) when the device setting
        allows and the build has it. ``device`` becomes where the session really runs: under
        "auto", a CUDA provider that did not load means the CPU; under "cuda", an error."""
        import onnxruntime as ort
        requested = self.settings.device
        session = ort.InferenceSession(model, sess_options=kwargs.pop("sess_options", None)
                                       or ort_session_options(self.threads),
                                       providers=device_gpu.ort_providers(requested), **kwargs)
        self.device = device_gpu.check_session_device(session, requested)
        return session

    def onnx_providers(self) -> list[Any]:
        """onnxruntime providers for the device setting (CUDA with its arena capped at the GPU
        budget when allowed and available), for a library that makes its own sessions."""
        return device_gpu.ort_providers(self.settings.device)

    def onnx_device(self, session: Any) -> str:
        """Where an onnxruntime session really runs ("cuda" or "cpu"), and ``device`` set to it;
        an error when the setting asked for "cuda" and the session did not get it."""
        self.device = device_gpu.check_session_device(session, self.settings.device)
        return self.device

    def onnx_run_options(self) -> Any:
        """Run options for sessions made by ``onnx_session``. Those have no CPU arena (it kept one
        big call's peak until the next call): a call's big tensors go back to the system as
        they are freed, so an idle service hands the memory back."""
        return ort_run_options()

    def torch_memory_budget(self, torch: Any) -> float | None:
        """Cap torch's share of the card at the planned budget; the fraction set, or None."""
        return device_gpu.apply_torch_budget(torch)


class Call:
    """One predict() call: which of its items are still wanted, and its progress.

    ``cancelled(i)`` is True once item i's client has gone or its deadline has passed (for a
    model with ``cancellable = True``); ``cancelled()`` once every item is; ``check()``
    raises then, to stop a long call between steps. ``progress(done, total)`` shows in the
    service's /stats while the call runs.
    """

    def __init__(self, events: list[threading.Event | None], progress: CallProgress | None = None):
        self._events = events
        self._progress = progress

    def __len__(self) -> int:
        return len(self._events)

    def cancelled(self, i: int | None = None) -> bool:
        if i is None:
            return bool(self._events) and all(e is not None and e.is_set() for e in self._events)
        event = self._events[i]
        return event is not None and event.is_set()

    def check(self) -> None:
        if self.cancelled():
            raise CallCancelled()

    def progress(self, done: float, total: float) -> None:
        if self._progress is not None:
            self._progress.update(done, total)


class CallProgress:
    """The running call's progress, written by the model's thread, read by /stats."""

    def __init__(self) -> None:
        self.doc: dict[str, Any] | None = None

    def begin(self, items: int) -> None:
        self.doc = {"items": items, "done": 0, "total": None, "started": time.time()}

    def update(self, done: float, total: float) -> None:
        doc = self.doc
        if doc is not None:
            self.doc = {**doc, "done": done, "total": total}

    def end(self) -> None:
        self.doc = None

    def snapshot(self) -> dict[str, Any] | None:
        doc = self.doc
        if doc is None:
            return None
        return {**doc, "running_s": round(time.time() - doc["started"], 3)}


class Model:
    """Subclass it; override what your model needs. See the module's documentation."""

    # the backend's name in /info and in the model label (default: the class name, lower-case)
    name: ClassVar[str] = ""
    # predict() may get items of several requests at once
    batching: ClassVar[bool] = False
    # predict() looks at call.cancelled()/call.check(): a request whose client left or whose
    # deadline passed is then answered at once, and its items may stop early
    cancellable: ClassVar[bool] = False
    # a floor for the cost model where a call's memory cannot be measured (onnxruntime on a GPU)
    memory_per_pixel: ClassVar[float] = 0.0
    # the model's GPU memory is torch's: a call's peak is measured with torch's allocator
    uses_torch: ClassVar[bool] = False
    # the default route: its picture fields (the first is required, and is what a raw
    # image/* body is), its parameters and its answer (both for OpenAPI; Params also for
    # request.params())
    image_fields: ClassVar[tuple[str, ...]] = ("image",)
    Params: ClassVar[type[Params] | None] = None
    Answer: ClassVar[Any] = None
    Settings: ClassVar[type[Settings]]  # set below: onecard.Settings

    settings: Settings        # the validated settings, set before setup()
    device: str | None = None  # where the model runs; default: Setup.device after setup()

    def setup(self, ctx: Setup) -> None:
        """Load the model (on the model's thread, before any request)."""

    def warmup_inputs(self) -> list[Any]:
        """Real items, as decode_request() makes them, for the warm-up calls and the cost curves."""
        return []

    def decode_request(self, request: Request) -> Any:
        """One request -> one item, or a list of items (default: the picture, an RGB array)."""
        return request.image()

    def predict(self, items: list[Any], call: Call) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__}.predict")

    def encode_response(self, output: Any, request: Request) -> Any:
        """An output (a list of them when decode_request returned a list) -> the answer
        (default: the output as JSON)."""
        return output

    # ---- optional hooks ------------------------------------------------------------------------
    def batch_key(self, item: Any) -> Hashable:
        """Items with equal keys may share a call (asked of a request's first item)."""
        return None

    def item_pixels(self, item: Any) -> int:
        """Pixels of the item as the model sees them: what a call's working memory grows with
        (default: an array's height x width, or an ``rgb``/``image`` attribute's; else 0)."""
        shape = getattr(item, "shape", None)
        if shape is not None and len(shape) >= 2:
            return int(shape[0]) * int(shape[1])
        return _default_pixels(None, item)  # type: ignore[arg-type]

    def item_work(self, item: Any) -> float:
        """What the item's share of a call's time grows with, any unit (default: its pixels, or 1)."""
        return float(self.item_pixels(item) or 1)

    def on_out_of_memory(self) -> None:
        """Free what can be freed after the device ran out of memory (the request gets 503)."""

    def info(self) -> dict[str, Any]:
        """More for /info (model, model_name: the label's last part, dtype, ...)."""
        return {}

    def gpu_memory_bytes(self) -> int | None:
        """GPU memory the model holds, for /stats and /metrics (None: unknown)."""
        return None

    def add_routes(self, service: Service) -> None:
        """More routes: model routes (``service.add_route(onecard.Route(...))``) and plain ones."""


def _default_settings() -> None:
    from onecard._settings import Settings
    Model.Settings = Settings


_default_settings()
