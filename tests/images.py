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


def progressive_jpeg(arr: np.ndarray | None = None) -> bytes:
    arr = arr if arr is not None else np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    return encode(arr, "JPEG", progressive=True, quality=90)


def scan_bomb_jpeg(extra_scans: int = 2000) -> bytes:
    """A small progressive JPEG whose last scan is repeated many times: each scan costs
    a decoder a full pass over the image (the 'thousands of scans' attack)."""
    data = progressive_jpeg()
    last_sos = data.rindex(b"\xff\xda")  # 0xFF in entropy data is stuffed (FF00): this is a marker
    scan = data[last_sos:-2]
    return data[:-2] + scan * extra_scans + b"\xff\xd9"


def nested_json(depth: int) -> bytes:
    return b'{"image": ' + b"[" * depth + b"]" * depth + b"}"


def exif_rotated_jpeg(arr: np.ndarray, orientation: int) -> bytes:
    """A JPEG whose stored pixels are `arr`, with an EXIF orientation tag."""
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()
