"""The public names that are the runtime's own: settings, errors, strict parameters. Defined
once in the runtime; here they get their public names and, for parameters, the helpers a
service author needs. Nothing heavier than pydantic is imported here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from onecard._settings import Settings
from services.runtime.codecs.params import Bool, Float, Int, Str, Text, inline_schema, query_parameters, validate
from services.runtime.codecs.params import Params as _RuntimeParams
from services.runtime.errors import ApiError

__all__ = ["Bool", "Error", "Float", "Int", "Params", "Settings", "Str", "Text", "openapi_schema"]


Error = ApiError


class Params(_RuntimeParams):
    """A request's parameters, strictly typed: unknown fields are refused (422). Declare fields
    with Float, Int, Bool, Str (or any pydantic type) and ``pydantic.Field`` bounds. Values
    from a query string or form fields are text and parsed ("0.5" is a number); JSON values
    must have the right type (``true`` is not a number, ``"5"`` is not an integer)."""

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> Params:
        """Validated, or an Error(422, "invalid_parameter") naming the fields at fault."""
        return validate(cls, data)

    @classmethod
    def query_parameters(cls) -> list[dict[str, Any]]:
        """The fields as OpenAPI query parameters."""
        return query_parameters(cls)


def openapi_schema(model: type[BaseModel], *, mode: str = "validation") -> dict[str, Any]:
    """A pydantic model's JSON schema with every reference inlined, to embed in an OpenAPI
    operation (a request body, an answer)."""
    return inline_schema(model, mode=mode)
