"""The advanced layer: more than one model route, and routes that are not model work.

``onecard.Route`` is a model route: its own path, decode and encode hooks (the Model's
signatures), picture fields, parameters and OpenAPI description; its items go through the
same queue, batches, budgets and deadlines as the default route's. ``onecard.Service`` is
what ``Model.add_routes`` gets: the FastAPI app for plain routes (progress, listings,
settings: they still pass auth, metrics and the error envelope), the bounded CPU pool,
bounded body reading, and error shapes for a family of paths.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from onecard._answers import to_reply
from onecard._request import Request
from onecard._types import openapi_schema
from services.runtime.codecs.forms import parse_json
from services.runtime.edge.body import read_body
from services.runtime.errors import ApiError
from services.runtime.pipeline.model_routes import ModelRoute, Reply, Work
from services.runtime.pipeline.raw_request import RawRequest

if TYPE_CHECKING:
    from starlette.requests import Request as HttpRequest

    from onecard._model import Model
    from services.runtime.shell.app import ServiceShell
    from services.runtime.shell.model_part import ModelPart

BINARY = {"schema": {"type": "string", "format": "binary"}}
IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp", "image/bmp")


@dataclass
class Route:
    """A model route. ``decode(request)`` -> an item or a list of items; ``encode(output,
    request)`` -> the answer (as Model.decode_request and Model.encode_response).

    OpenAPI: ``image_fields``, ``params`` (a Params class) and ``answer`` (a pydantic model of
    the JSON answer) describe the route; ``request_body``/``responses`` replace what they
    would give. A route always takes JSON, so that the jobs service can run it.
    ``error_body(error) -> dict`` answers this route's errors in its own shape."""
    path: str
    decode: Callable[[Request], Any]
    encode: Callable[[Any, Request], Any]
    image_fields: tuple[str, ...] = ("image",)
    params: Any = None
    answer: Any = None
    summary: str = ""
    description: str = ""
    tags: list[str] = field(default_factory=list)
    request_body: dict[str, Any] | None = None
    responses: dict[int | str, Any] | None = None
    error_body: Callable[[ApiError], dict] | None = None


class Slot:
    """An item on its way through the queue, with the event that cancels it (cancellable models)."""

    __slots__ = ("item", "cancel")

    def __init__(self, item: Any, cancellable: bool):
        self.item = item
        if cancellable:
            self.cancel = threading.Event()


def model_route(route: Route, model: Model) -> ModelRoute:
    """The runtime's ModelRoute for a public Route."""
    settings = model.settings

    def decode(raw: RawRequest) -> Work:
        request = Request(raw, settings, route.image_fields, route.params)
        got = route.decode(request)
        many = isinstance(got, list)
        items = got if many else [got]
        slots = [Slot(item, model.cancellable) for item in items]
        key = model.batch_key(items[0]) if items else None
        return Work(slots, key, (request, many))

    def encode(work: Work, results: list[Any], raw: RawRequest) -> Reply:
        request, many = work.state
        return to_reply(route.encode(results if many else results[0], request), request)

    return ModelRoute(route.path, decode, encode, summary=route.summary, description=route.description,
                      tags=list(route.tags), request_body=route.request_body or request_body(route),
                      parameters=route.params.query_parameters() if route.params is not None and
                      hasattr(route.params, "query_parameters") else [],
                      responses=route.responses if route.responses is not None else answer_schema(route),
                      error_body=route.error_body)


def request_body(route: Route) -> dict[str, Any]:
    """OpenAPI for the input forms the route takes: a raw picture, a multipart form, JSON."""
    params = openapi_schema(route.params) if route.params is not None else {"type": "object"}
    properties = dict(params.get("properties", {}))
    required = list(params.get("required", []))
    content: dict[str, Any] = {}
    if route.image_fields:
        content.update({mime: BINARY for mime in IMAGE_TYPES})
        for n, name in enumerate(route.image_fields):
            properties[name] = {"type": "string", "description": f"the picture{'' if n == 0 else ' ' + name}, "
                                                                 f"base64 (a data: URL prefix is allowed)"}
        required.insert(0, route.image_fields[0])
        form = {name: {"type": "string", "format": "binary"} for name in route.image_fields}
        form.update({k: v for k, v in properties.items() if k not in form})
        content["multipart/form-data"] = {"schema": {"type": "object", "required": [route.image_fields[0]],
                                                     "properties": form}}
    json_schema = {**params, "type": "object", "properties": properties}
    if required:
        json_schema["required"] = required
    content["application/json"] = {"schema": json_schema}
    return {"required": bool(route.image_fields), "content": content}


def answer_schema(route: Route) -> dict[int | str, Any]:
    if route.answer is None:
        return {}
    return {200: {"description": "the answer",
                  "content": {"application/json": {"schema": openapi_schema(route.answer, mode="serialization")}}}}


class Service:
    """What Model.add_routes gets."""

    def __init__(self, app: FastAPI, part: ModelPart, shell: ServiceShell, model: Model):
        self.app = app
        self.settings = model.settings
        self._part, self._shell, self._model = part, shell, model

    def add_route(self, route: Route) -> None:
        """Another model route."""
        self._part.pipeline.add(self.app, model_route(route, self._model))

    async def run_cpu(self, fn: Callable, *args: Any) -> Any:
        """Run CPU work (parsing, encoding, file reads) in the service's bounded pool: a plain
        route's handler runs on the event loop, which must never do that work itself."""
        return await self._part.pipeline.cpu.run(fn, *args)

    async def read_body(self, request: HttpRequest, max_bytes: int | None = None) -> bytes:
        """A plain route's body, within max_bytes (default max_body_bytes): 413 beyond, and 413
        for a JSON body over max_json_items items (counted before it is parsed)."""
        return await read_body(request, max_bytes or self.settings.max_body_bytes,
                               max_json_items=self.settings.max_json_items,
                               max_json_depth=self.settings.max_json_depth)

    def parse_json(self, body: bytes) -> Any:
        """JSON within the service's depth limit, numbers finite (CPU work: in run_cpu)."""
        return parse_json(body, self.settings.max_json_depth)

    def error_shape(self, path: str, shape: Callable[[ApiError], dict]) -> None:
        """Errors of ``path`` (a prefix when it ends with "/"), 401s included, answered as
        ``shape(error)`` instead of the envelope."""
        self._shell.error_shapes[path] = shape

    def open_path(self, path: str) -> None:
        """A path clients may call without credentials."""
        self._shell.open_paths = self._shell.open_paths | {path}
