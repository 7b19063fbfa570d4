"""``onecard.serve(Model)``: the app factory the unit's config names.

The factory validates the service's settings section with ``Model.Settings``, makes the
model, and builds the service on the runtime: the shell (probes, auth, drain, metrics) and
the pipeline (admission, cost model, scheduler, batching) in front of an adapter that
calls the model's hooks (``ModelBackend``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from onecard._model import Call, CallCancelled, CallProgress, Model, Setup
from onecard._routes import Route, Service, Slot
from services.runtime.device.threads import planned_threads
from services.runtime.pipeline.backend import Backend
from services.runtime.pipeline.contained import contained
from services.runtime.shell.model_part import ModelPart, model_service_app


class ModelBackend(Backend):
    """The runtime's backend interface (load, warm-up items, a batch) on a Model's hooks."""

    def __init__(self, model: Model, service_name: str):
        self.model = model
        self.service_name = service_name
        self.name = model.name or _snake(type(model).__name__)
        self.supports_batching = bool(model.batching)
        self.uses_torch = bool(model.uses_torch)
        self.memory_per_pixel = float(model.memory_per_pixel)
        self.device: str | None = None
        self.call_progress = CallProgress()

    def load(self) -> None:
        ctx = Setup(self.service_name, self.model.settings, planned_threads())
        self.model.setup(ctx)
        self.device = self.model.device or ctx.device
        self.model.device = self.device

    def warmup_items(self) -> list[Any]:
        return [Slot(item, False) for item in self.model.warmup_inputs()]

    def infer_batch(self, slots: list[Slot]) -> list[Any]:
        call = Call([getattr(s, "cancel", None) for s in slots], self.call_progress)
        self.call_progress.begin(len(slots))
        try:
            outputs = self.model.predict([s.item for s in slots], call)
        except CallCancelled:
            return [CallCancelled() for _ in slots]
        finally:
            self.call_progress.end()
        if not isinstance(outputs, (list, tuple)):
            raise TypeError(f"{type(self.model).__name__}.predict returned {type(outputs).__name__}; "
                            f"expected a list with one output per item")
        return list(outputs)

    # (these four run on the event loop: a sys.exit() in them would end the service there)
    def item_pixels(self, slot: Slot) -> int:
        return contained(self.model.item_pixels, slot.item)

    def item_work(self, slot: Slot) -> float:
        return contained(self.model.item_work, slot.item)

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "device": self.device, **contained(self.model.info)}

    def gpu_memory_bytes(self) -> int | None:
        return contained(self.model.gpu_memory_bytes)

    def on_out_of_memory(self) -> None:
        self.model.on_out_of_memory()

    def progress(self) -> dict[str, Any] | None:
        return self.call_progress.snapshot()


def serve(model: type[Model], route: str | None = "/api/v1/predict", *, title: str | None = None,
          description: str | None = None, summary: str = "") -> Callable[[dict[str, Any]], FastAPI]:
    """The app factory for a model: ``create_app = onecard.serve(MyModel, route="/api/v1/mine")``.

    ``route`` is the default route's path (None: only the routes add_routes adds); ``title``
    and ``description`` head the OpenAPI document (default: the class's name and docstring).
    The service's name in the unit (ONECARD_SERVICE_NAME, default the class's name) names
    it in logs, /info and the model label."""
    if not (isinstance(model, type) and issubclass(model, Model)):
        raise TypeError("onecard.serve takes a subclass of onecard.Model")
    doc = (model.__doc__ or "").strip()

    def create_app(settings: dict[str, Any]) -> FastAPI:
        cfg = model.Settings.model_validate(settings)
        name = os.environ.get("ONECARD_SERVICE_NAME") or _snake(model.__name__)
        instance = model()
        instance.settings = cfg
        backend = ModelBackend(instance, name)

        def add_routes(app: FastAPI, part: ModelPart, shell) -> None:
            service = Service(app, part, shell, instance)
            if route:
                service.add_route(Route(route, instance.decode_request, instance.encode_response,
                                        image_fields=tuple(model.image_fields), params=model.Params,
                                        answer=model.Answer, summary=summary or f"{model.__name__}",
                                        description=doc))
            instance.add_routes(service)

        return model_service_app(name, cfg, backend, add_routes, title=title or f"onecard {name}",
                                 description=description if description is not None else doc)

    create_app.model = model  # type: ignore[attr-defined]
    return create_app


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
