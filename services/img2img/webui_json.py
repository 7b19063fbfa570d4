"""What a webui request's JSON may hold, and base64 pictures as the webui reads them.

JSON can carry a lone UTF-16 surrogate (``"\\ud800"``) that Python parses into a string
no UTF-8 encoder accepts: stored, it breaks every later answer that contains it (the
options document, a PNG's infotext). Such a string is refused where it arrives, with
a 422 naming the field, anywhere in the document (keys too).

The webui decodes base64 leniently; clients that wrap it as MIME does (a line break
every 76 characters) rely on that. Whitespace is dropped before the strict decode;
anything else that is not base64 is still a 400.
"""

from __future__ import annotations

import re
from typing import Any

import onecard
from onecard import Error

_SURROGATE = re.compile("[\ud800-\udfff]")
_WHITESPACE = re.compile(r"[ \t\r\n\f\v]+")


def _path(parts: tuple) -> str:
    return ".".join(str(p) for p in parts) or "body"


def refuse_lone_surrogates(doc: Any, where: tuple = ()) -> None:
    """422 for the first string (or key) that holds a lone surrogate. One visit per node,
    no recursion (the depth was bounded by the parser); ASCII strings, base64 pictures
    among them, are passed over at C speed."""
    stack: list[tuple[tuple, Any]] = [(where, doc)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            if not node.isascii() and _SURROGATE.search(node):
                raise Error(422, "invalid_parameter", f"{_path(path)}: holds a lone UTF-16 surrogate, which is not "
                                                         f"text (it cannot be written as UTF-8)")
        elif isinstance(node, dict):
            for key, value in node.items():
                if not key.isascii() and _SURROGATE.search(key):
                    raise Error(422, "invalid_parameter", f"{_path(path) + '.' if path else ''}{key!a}: a key with "
                                                             f"a lone UTF-16 surrogate, which is not text")
                stack.append(((*path, key), value))
        elif isinstance(node, list):
            stack.extend(((*path, i), value) for i, value in enumerate(node))


def read_webui_json(request: onecard.Request) -> dict[str, Any]:
    """The body as a JSON object (415/400/422 as for every JSON route), its text valid Unicode."""
    doc = request.json()
    if not isinstance(doc, dict):
        raise Error(422, "invalid_parameter", "body: expected a JSON object")
    refuse_lone_surrogates(doc)
    return doc


def picture_bytes(text: Any, name: str, max_bytes: int) -> bytes:
    """A base64 picture field: a data: URL prefix allowed, MIME line breaks and other
    whitespace ignored as the webui ignores them."""
    if isinstance(text, str) and not text.startswith(("http://", "https://")):
        if any(c in text for c in " \r\n\t\f\v"):  # a substring test is C speed; most pictures have none
            text = _WHITESPACE.sub("", text)
    elif isinstance(text, str):
        raise Error(422, "invalid_parameter", f"{name}: a URL; this service does not fetch pictures, send base64")
    return onecard.decode_base64(text, name, max_bytes)
