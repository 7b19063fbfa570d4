"""Request parameters, strictly typed: a boolean is not a number, numbers are finite.

Parameters arrive from two kinds of source. JSON bodies carry typed values: there a
number must be a JSON number (``true`` or ``"5"`` is a 422), an integer may be written
``20.0`` but not ``20.5``, and every float must be finite. Query strings and form fields
carry text: there ``"0.5"`` is parsed as a number, still finite and in range. Text values
are marked by their type (``Text``), so one model validates both, even mixed in one
request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from services.runtime.errors import ApiError


class Text(str):
    """A parameter value that came as text (query string, form field)."""


def as_text(values: Mapping[str, str]) -> dict[str, Text]:
    return {k: Text(v) for k, v in values.items()}


def _number(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, str):
        if not isinstance(value, Text):
            raise ValueError("expected a number, got a string")
        text = value.strip()
        try:
            value = int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text[:40]!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("expected a finite number")
    if not isinstance(value, (int, float)):
        raise ValueError("expected a number")
    return value


def _integer(value: Any) -> Any:
    value = _number(value)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("expected a whole number")
        value = int(value)
    return value


def _boolean(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, Text):
        low = value.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
    raise ValueError("expected true or false")


def _string(value: Any) -> Any:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return str(value)


Float = Annotated[float, BeforeValidator(_number), Field(allow_inf_nan=False)]
Int = Annotated[int, BeforeValidator(_integer)]
Bool = Annotated[bool, BeforeValidator(_boolean)]
Str = Annotated[str, BeforeValidator(_string)]


class Params(BaseModel):
    """Base for request parameter models: unknown fields are refused."""
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# A field's name as an error message quotes it: a client's key may be megabytes long (an
# unknown key is named in the 422), and the answer should not echo it whole.
MAX_NAME_CHARS = 120


def field_path(loc: tuple[Any, ...] | list[Any], default: str = "body") -> str:
    """A validation error's location ("init_images.0"), cut short when a client's key is long."""
    where = ".".join(str(p)[:MAX_NAME_CHARS + 1] for p in loc) or default
    return where if len(where) <= MAX_NAME_CHARS else where[:MAX_NAME_CHARS] + "..."


def describe(exc: ValidationError, limit: int = 5) -> str:
    msgs = []
    for e in exc.errors()[:limit]:
        where = field_path(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        msgs.append(f"{where}: {msg}")
    return "; ".join(msgs)


def validate(model: type[BaseModel], data: Mapping[str, Any]) -> Any:
    """The model, or a 422 naming the fields at fault."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise ApiError(422, "invalid_parameter", describe(exc)) from None


def merge(query: Mapping[str, str], body: Mapping[str, Any]) -> dict[str, Any]:
    """Query parameters (text) and body fields together; a field given both ways is
    refused rather than silently picking one."""
    both = sorted(set(query) & set(body))
    if both:
        raise ApiError(422, "invalid_parameter", f"{both[0]}: given both in the query string and in the body")
    return {**as_text(query), **body}


def inline_schema(model: type[BaseModel], *, mode: str = "validation") -> dict[str, Any]:
    """A model's JSON schema with every $defs reference inlined, for embedding in an
    OpenAPI operation (a "#/$defs/..." reference would point at the document's root)."""
    schema = model.model_json_schema(mode=mode)
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                # what sits beside the reference (the field's description, default) is kept
                rest = {k: resolve(v) for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[ref.rsplit("/", 1)[1]]), **rest}
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


def query_parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    """OpenAPI query parameters for a parameter model's fields."""
    schema = inline_schema(model)
    required = set(schema.get("required", ()))
    return [{"name": name, "in": "query", "required": name in required, "schema": prop,
             **({"description": prop["description"]} if "description" in prop else {})}
            for name, prop in schema["properties"].items()]  # pydantic always writes it
