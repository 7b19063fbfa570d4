"""What each output encoder can write, checked before the work that would produce it.

libwebp writes at most 16383 px a side and libjpeg(-turbo) at most 65500; PNG's own
limit is 2^31 - 1. A picture over its format's limit fails inside the encoder, after
the model has run: a route checks the size it will answer with, for the format it will
use, while it decodes the request, and answers 422 with the figures instead.
"""

from __future__ import annotations

from services.runtime.errors import ApiError

MAX_SIDE = {"png": 2**31 - 1, "jpeg": 65500, "webp": 16383}


def over_limit(width: int, height: int, fmt: str) -> str | None:
    """Why `fmt` cannot hold a width x height picture, or None when it can."""
    limit = MAX_SIDE[fmt]
    if width > limit or height > limit:
        return f"{width}x{height} px: {fmt.upper()} holds at most {limit} px a side"
    return None


def check_encodable(width: int, height: int, fmt: str, what: str = "the answer") -> None:
    """422 naming the size, the format and its limit, before any work is done for it."""
    why = over_limit(width, height, fmt)
    if why is not None:
        raise ApiError(422, "output_too_large", f"{what} would be {why}; ask for a smaller size or another format")
