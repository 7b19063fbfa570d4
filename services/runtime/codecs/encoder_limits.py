"""What each output encoder can write, checked before the work that would produce it.

libwebp writes at most 16383 px a side and libjpeg(-turbo) at most 65500; PNG's own
limit is 2^31 - 1. A picture over its format's limit fails inside the encoder, after
the model has run: a route checks the size it will answer with, for the format it will
use, while it decodes the request, and answers 422 with the figures instead.

Each encoder also holds memory of its own while it writes, besides the pixels it is given
and the answer it returns: ``working_bytes`` is what the cost model charges for it.
"""

from __future__ import annotations

from services.runtime.errors import ApiError

MAX_SIDE = {"png": 2**31 - 1, "jpeg": 65500, "webp": 16383}

# Bytes a pixel an encoder holds at its peak beyond its answer (charged at 3 bytes a pixel,
# an incompressible picture's raw size), measured on noise at quality 100, the worst case
# (tests/unit/test_encoder_charges.py): PNG its filtered rows (3.4); JPEG OpenCV's BGR copy
# and its output buffer (4.0), and an EXIF block's copy of the answer (2.0 more); WebP
# OpenCV's BGR copy and libwebp's token buffers, which grow with the quality and the detail
# (28.8 at quality 100 on noise, 3.3 on a photo at 85), or, for a small picture, Pillow's
# method 0 (12.2)
WORKING_PER_PIXEL = {"png": 4.0, "jpeg": 6.0, "webp": 31.0}
SMALL_WEBP_PIXELS = 1 << 18    # encoded by Pillow (images.PILLOW_WEBP_MAX_PIXELS)
SMALL_WEBP_PER_PIXEL = 14.0
WORKING_FLOOR = 1 << 20        # an encoder's own tables, whatever the size


def working_bytes(pixels: int, fmt: str | None) -> int:
    """What encoding one picture of `pixels` in `fmt` holds besides the pixels and its answer
    (PNG's figure when the format is not known)."""
    if pixels <= 0:
        return 0
    fmt = fmt if fmt in WORKING_PER_PIXEL else "png"
    per_pixel = SMALL_WEBP_PER_PIXEL if fmt == "webp" and pixels <= SMALL_WEBP_PIXELS else WORKING_PER_PIXEL[fmt]
    return int(pixels * per_pixel) + WORKING_FLOOR


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
