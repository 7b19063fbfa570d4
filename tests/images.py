"""Real test images: scikit-image's astronaut and coffee, insightface's group photo, and crafted bad ones."""

from __future__ import annotations

import importlib.resources
import io
import struct
import zlib

import numpy as np
from PIL import Image


def encode(arr: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


def astronaut() -> np.ndarray:
    from skimage import data
    return data.astronaut()


def coffee() -> np.ndarray:
    """A photo with no face in it."""
    from skimage import data
    return data.coffee()


def group_photo_jpeg() -> bytes:
    """Six faces; ships inside the insightface wheel."""
    return (importlib.resources.files("insightface") / "data" / "images" / "t1.jpg").read_bytes()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def pixel_bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid PNG header declaring a huge image, with a tiny body."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def small_png() -> bytes:
    return encode(np.full((32, 48, 3), 127, dtype=np.uint8))
