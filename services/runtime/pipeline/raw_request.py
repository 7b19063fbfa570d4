"""What a route's decode hook sees of a request: everything read, nothing parsed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawRequest:
    """What a route's decode hook sees: everything read, nothing parsed."""
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]          # lower-case names; a repeated header keeps its last value
    content_type: str                # media type only, lower-case
    content_type_header: str
    body: bytes = b""
    extra: dict[str, Any] = field(default_factory=dict)  # what a route passes to its hooks
    cost: Any = None                 # a RequestCost: the hook states the request's cost before decoding
