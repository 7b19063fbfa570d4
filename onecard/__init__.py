"""onecard: a model service on one GPU card, beside the others, in about twenty lines.

    import onecard

    class Shout(onecard.Model):
        def decode_request(self, request: onecard.Request):
            return request.text()

        def predict(self, items: list, call: onecard.Call) -> list:
            return [text.upper() for text in items]

        def encode_response(self, output, request: onecard.Request):
            return {"text": output}

    create_app = onecard.serve(Shout, route="/api/v1/shout")

The unit's config names the factory (``[services.shout] app = "shout:create_app"``). What
the runtime enforces holds for such a service with nothing for its author to do:
admission, the cost model and budgets, limits, deadlines, cancellation, the strict FIFO
lock on the GPU, batching, metrics, Server-Timing, probes, readiness after real warm-up,
the jobs API and auth. docs/services/writing-a-service.md walks through one;
docs/services/api.md is the reference.

This package is the only public import path. Its names are ``__all__`` (and
``onecard.testing``); ``API_VERSION`` says what a service may rely on: a minor version
adds names and optional parameters, a major version may change or remove them. Every
name is imported when first used, so that ``import onecard`` stays cheap (the supervisor's
``onecard check`` imports a service's settings module).
"""

from __future__ import annotations

import importlib
from typing import Any

API_VERSION = "1.6"

_NAMES = {
    # writing a model service
    "Model": "onecard._model", "Setup": "onecard._model", "Call": "onecard._model",
    "Request": "onecard._request", "Settings": "onecard._settings", "Params": "onecard._types",
    "Error": "onecard._types", "serve": "onecard._serve",
    # answers
    "Response": "onecard._answers", "image": "onecard._answers",
    # strict parameter types (a boolean is not a number, numbers are finite)
    "Float": "onecard._types", "Int": "onecard._types", "Bool": "onecard._types", "Str": "onecard._types",
    "Text": "onecard._types",
    # the advanced layer: several routes, plain routes, pictures in custom fields
    "Route": "onecard._routes", "Service": "onecard._routes", "ImageHeader": "onecard._answers",
    "IMAGE_FORMATS": "onecard._answers", "openapi_schema": "onecard._types",
    "decode_base64": "onecard._answers", "encode_base64": "onecard._answers", "encode_image": "onecard._answers",
    "encode_image_base64": "onecard._answers",
    "check_encodable": "onecard._answers", "resize_image": "onecard._answers",
}

__all__ = ["API_VERSION", "__version__", *_NAMES]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from services.runtime.shell.metrics import version
        return version()
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'onecard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
