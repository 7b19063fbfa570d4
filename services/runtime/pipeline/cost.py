"""One cost model per service: what a request and a batch cost, known before they run.

``ServiceCost`` holds the learned time curve and memory curve (costmodel.py), the
budgets (budget.py) and the ledger of what admitted requests hold. A decode hook states
what its request will cost through ``RequestCost.check`` BEFORE it decodes anything
(image sizes come from headers): items, the pixels the model sees per item, the pixels
decoded and produced, the bytes of the answer. Each figure is multiplied out and checked
against the budgets: a count within its limit times a size within its limit is still
refused when the product is not. The batch loop asks ``call_fits`` before it adds an item
to a batch, and splits a request's items over several calls when they do not fit in one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.runtime.codecs.encoder_limits import working_bytes
from services.runtime.errors import ApiError
from services.runtime.pipeline.budgets import Budgets, Charge, HeldMemory, mib
from services.runtime.pipeline.cost_curves import BatchCurve, MemoryCurve

BYTES_PER_PIXEL = 3          # RGB, 8 bits a channel, as decoded and as produced
BASE64 = 4 / 3
ANSWER_OVERHEAD = 4096


@dataclass(frozen=True)
class CostEstimate:
    items: int
    input_pixels: int        # decoded from the request
    model_pixels: int        # the largest item, as the model sees it
    output_pixels: int       # produced in all
    output_bytes: int        # the encoded answer, held until the client reads it
    held_bytes: int          # everything this request holds at its peak
    call_bytes: int          # working memory of a model call on its largest item
    # whether the hook said what its answer weighs (output_pixels or output_bytes); if not,
    # output_bytes is a small JSON answer's guess, counted but not told as an estimate
    output_stated: bool = True

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def public(self) -> dict[str, int | None]:
        """The dry run's ``cost``: output_bytes is null where the hook did not say (the jobs
        service then reserves result_reserve_bytes for the result, not a 4 KiB guess)."""
        doc: dict[str, int | None] = {k: v for k, v in self.as_dict().items() if k != "output_stated"}
        if not self.output_stated:
            doc["output_bytes"] = None
        return doc


def output_bytes_for(pixels: int, base64: bool = False) -> int:
    """An encoded answer's size at most: an incompressible picture is its raw size, and a
    PNG of noise a little more (a filter byte a row, zlib's stored blocks: 0.2 % at 2000 px a
    row), which the 1/64 covers from rows of 22 pixels on."""
    raw = pixels * BYTES_PER_PIXEL
    raw += raw // 64
    return int(raw * (BASE64 if base64 else 1.0)) + ANSWER_OVERHEAD


class ServiceCost:
    """The service's cost model and budgets; the ledger of held memory."""

    def __init__(self, backend: Any, max_batch: int):
        self.backend = backend
        self.curve = BatchCurve(max_batch)
        self.memory = MemoryCurve(floor_per_pixel=float(getattr(backend, "memory_per_pixel", 0.0) or 0.0))
        self.reference_work = 1.0
        self.budgets: Budgets | None = None
        self.held: HeldMemory | None = None
        self.probe: Any = None        # the warm-up's PeakProbe: live calls measure with it when precise

    # ---- what the backend says an item weighs ------------------------------------------
    def item_pixels(self, item: Any) -> int:
        try:
            return max(0, int(self.backend.item_pixels(item)))
        except Exception:  # noqa: BLE001 - a figure; never a reason to fail a request
            return 0

    def item_work(self, item: Any) -> float:
        try:
            work = float(self.backend.item_work(item))
        except Exception:  # noqa: BLE001
            return self.reference_work
        return work if math.isfinite(work) and work > 0 else self.reference_work

    # ---- time -------------------------------------------------------------------------
    def work_ratio(self, items: Sequence[Any]) -> float:
        if not items:
            return 1.0
        return sum(self.item_work(i) for i in items) / len(items) / self.reference_work

    def call_seconds(self, size: int, work_ratio: float = 1.0) -> float | None:
        secs = self.curve.seconds(size)
        return None if secs is None else secs * work_ratio

    def observe_call(self, items: Sequence[Any], seconds: float, peak_bytes: int | None) -> None:
        ratio = self.work_ratio(items)
        if ratio > 0:
            self.curve.observe(len(items), seconds / ratio)
        if peak_bytes is not None:
            self.memory.observe(sum(self.item_pixels(i) for i in items), peak_bytes)

    # ---- memory -----------------------------------------------------------------------
    def call_bytes(self, pixels: int) -> int:
        return self.memory.call_bytes(pixels)

    @property
    def call_on_gpu(self) -> bool:
        """Whether a call's working memory is on the card: trimming the host heap after it
        would only stall the model (malloc_trim on the worker: tens of ms a call)."""
        return self.budgets is not None and self.budgets.batch_on_gpu

    def call_fits(self, pixels: int) -> bool:
        """Whether one model call on items of `pixels` in all fits its working memory."""
        return self.budgets is None or self.call_bytes(pixels) <= self.budgets.batch_bytes

    def new_charge(self) -> Charge:
        return Charge(self.held)

    def snapshot(self) -> dict[str, Any]:
        held = self.held
        return {"time": self.curve.snapshot(), "memory": self.memory.snapshot(),
                "budgets": None if self.budgets is None else self.budgets.snapshot(),
                "held_bytes": None if held is None else held.used,
                "held_peak_bytes": None if held is None else held.peak,
                "refused_for_memory": None if held is None else held.refused,
                "waited_for_memory": None if held is None else held.waited}


class DryRunComplete(Exception):
    """Raised by ``RequestCost.check`` in a dry run once the cost is known and accepted: the
    decode hook stops there (nothing is decoded), and the runtime answers the dry run."""


class RequestCost:
    """Handed to a decode hook (``raw.cost``): state the request's cost before decoding."""

    def __init__(self, service: ServiceCost | None, charge: Charge, body_bytes: int = 0, dry_run: bool = False):
        self.service = service
        self.charge = charge
        self.body_bytes = body_bytes
        self.dry_run = dry_run
        self.estimate: CostEstimate | None = None
        self.body_copies = 0

    def hold_body_copies(self, extra: int) -> None:
        """What parsing the body is about to copy out of it (a JSON document's strings, the
        pictures its base64 decodes to, multipart parts), held with the body from now on:
        a 20 MB JSON picture holds about 2.75 times its body once parsed and decoded, and
        sixteen of them took the service past its budget while only their bodies counted.
        Waits its turn (MemoryWait) like the body when others hold the room."""
        extra = int(extra)
        if extra <= self.body_copies:
            return
        grow = extra - self.body_copies
        held = (self.estimate.held_bytes if self.estimate is not None else self.body_bytes) + grow
        budgets = self.service.budgets if self.service is not None else None
        if budgets is not None and held > budgets.request_bytes:
            raise ApiError(413, "too_costly",
                           f"this request would hold about {mib(held)} once its body is parsed (the body, the "
                           f"text and pictures copied out of it); one request may hold "
                           f"{mib(budgets.request_bytes)}: send a smaller body (a picture as raw bytes or "
                           f"multipart costs less than base64 in JSON)")
        # counted before the hold: when it waits its turn (MemoryWait) the pipeline grants it
        # and runs the hook again, whose cost check must then count the copies, not shrink
        # the holding back to the body alone (and wait again to grow it)
        self.body_copies = extra
        self.body_bytes += grow
        if self.estimate is not None:
            self.estimate = CostEstimate(**{**self.estimate.as_dict(), "held_bytes": held})
        self.charge.hold(held, "the body's contents", wait=True)

    def check(self, *, items: int = 1, item_pixels: int | Iterable[int] = 0, input_pixels: int = 0,
              output_pixels: int = 0, output_bytes: int | None = None, base64_output: bool = False,
              answer_format: str | None = None, encoded_pixels: int | None = None,
              dry_run_stops_here: bool = True) -> CostEstimate:
        """Refuse (413) what could never run, or (503) what does not fit now; else hold it.

        `item_pixels` is what the model sees per item (one figure for all, or one each).
        The encoder's own memory for `answer_format` (PNG's when not said) is counted for the
        largest picture encoded at once: `encoded_pixels`, else output_pixels over the items.
        May be called again with larger figures (a request learns more as it goes): the
        holding grows to the new total. In a dry run (``X-Onecard-Dry-Run``) an accepted
        cost ends the hook here (DryRunComplete): nothing is decoded."""
        per_item = [int(p) for p in item_pixels] if not isinstance(item_pixels, int) else [int(item_pixels)] * items
        items = max(items, len(per_item)) if per_item else items
        largest = max(per_item, default=0)
        stated = output_bytes is not None or output_pixels > 0
        if output_bytes is None:
            output_bytes = output_bytes_for(output_pixels, base64_output) if output_pixels else ANSWER_OVERHEAD
        if encoded_pixels is None:
            encoded_pixels = -(-int(output_pixels) // max(1, items))
        encoding = working_bytes(int(encoded_pixels), answer_format) if output_pixels else 0
        held = (self.body_bytes + BYTES_PER_PIXEL * (input_pixels + sum(per_item) + output_pixels)
                + int(output_bytes) + encoding)
        service = self.service
        call = service.call_bytes(largest) if service is not None else 0
        estimate = CostEstimate(items, int(input_pixels), largest, int(output_pixels), int(output_bytes), held, call,
                                stated)
        self.estimate = estimate
        self.charge.estimate = estimate.as_dict()
        budgets = service.budgets if service is not None else None
        if budgets is not None:
            if call > budgets.batch_bytes:
                raise ApiError(413, "too_costly",
                               f"one item of {largest} pixels needs about {mib(call)} of working memory in a model "
                               f"call; this service's calls may use {mib(budgets.batch_bytes)}: send a smaller "
                               f"picture or size")
            if held > budgets.request_bytes:
                raise ApiError(413, "too_costly",
                               f"this request would hold about {mib(held)} ({items} item(s), {input_pixels} pixels "
                               f"decoded, {output_pixels} produced, answer up to {mib(output_bytes)}, its encoder "
                               f"{mib(encoding)}{' in ' + answer_format if answer_format else ''}); one request "
                               f"may hold {mib(budgets.request_bytes)}: send fewer or smaller pictures"
                               f"{', or ask for a PNG or JPEG answer' if answer_format == 'webp' else ''}")
        self.charge.hold(held, wait=True)  # the pipeline waits its turn for the room (MemoryWait)
        if self.dry_run and dry_run_stops_here:
            raise DryRunComplete()
        return estimate
