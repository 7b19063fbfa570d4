"""PNG answers made with the GIL released for nearly all of the work.

OpenCV's ``imencode`` compresses with the GIL released, but hands its output over to Python
(a numpy array of it, then its own buffer freed) with the GIL held: for a 36 MB PNG (a
12 MP answer) 6 ms when numpy's huge pages came at once and 30 to 90 ms when the kernel
compacted memory to find them (19 ms on 4 KiB pages), and the event loop and its probes
waited that long behind every big answer.
Here the same PNG (8-bit RGB, the Up filter on every row, zlib level 1 with run-length
matching: PNG_PARAMS) is made in steps that each release the GIL or hold it for one slice
only: the filter is a numpy subtraction, zlib compresses a megabyte of rows per call
(Python's zlib releases the GIL for each call; its output, about a megabyte, is copied
holding it), the checksums are zlib's, and the answer is joined by memmove (fresh_bytes).
The bytes are the standard format: any decoder reads them back to the same pixels.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from services.runtime.codecs.fresh_bytes import joined
from services.runtime.codecs.page_release import hand_back_pages

SIGNATURE = b"\x89PNG\r\n\x1a\n"
SLICE_BYTES = 1 << 20     # filtered rows handed to zlib per call
PIECE_MIN_BYTES = 64 * 1024
_UP = 2                   # PNG filter type 2: each byte minus the one above it
_IDAT_CRC = zlib.crc32(b"IDAT")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))


def text_chunk(key: str, text: str) -> bytes:
    """A text chunk as Pillow's PngInfo.add_text writes it: tEXt when the text is Latin-1,
    else an uncompressed iTXt in UTF-8. The keyword is 1 to 79 Latin-1 characters (PNG's rule)."""
    if not 1 <= len(key) <= 79 or not all(" " <= c <= "~" or "\xa1" <= c <= "\xff" for c in key):
        raise ValueError(f"a PNG text keyword is 1 to 79 printable Latin-1 characters, not {key[:100]!r}")
    try:
        name, data = b"tEXt", key.encode("latin-1") + b"\x00" + text.encode("latin-1")
    except UnicodeEncodeError:
        name, data = b"iTXt", key.encode("latin-1") + b"\x00\x00\x00\x00\x00" + text.encode("utf-8")
    return _chunk(name, data)


def encode_png(rgb: np.ndarray, texts: dict[str, str] | None = None) -> bytes:
    """``rgb`` (height x width x 3, uint8) as a PNG file, with `texts` (keyword: text) in text
    chunks right after its header."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8 or rgb.size == 0:
        raise ValueError(f"encode_png takes height x width x 3 uint8 pixels, not {rgb.shape} {rgb.dtype}")
    height, width = rgb.shape[:2]
    rows = np.ascontiguousarray(rgb).reshape(height, width * 3)
    garbage = [np.empty((height, width * 3 + 1), np.uint8)]
    filtered = garbage[0]
    filtered[0, 1:] = rows[0]                                             # the row above the first is zeros
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])               # modulo 256, as PNG's filters are
    filtered[:, 0] = _UP  # after: the subtraction faulted the pages in without the GIL, this would with it
    flat = memoryview(filtered).cast("B")
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)   # 8-bit RGB, not interlaced
    pieces: list[bytes | memoryview] = [SIGNATURE, _chunk(b"IHDR", header)]
    pieces += [text_chunk(key, text) for key, text in (texts or {}).items()]
    deflate = zlib.compressobj(1, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    for at in range(0, len(flat), SLICE_BYTES):
        _idat(pieces, deflate.compress(flat[at:at + SLICE_BYTES]))
    _idat(pieces, deflate.flush())
    pieces.append(_chunk(b"IEND", b""))
    del flat, filtered
    hand_back_pages(garbage)  # 36 MB of filtered rows for 12 MP: unmapped without the GIL
    garbage.clear()
    data = joined(pieces, sum(map(len, pieces)))
    hand_back_pages(pieces, PIECE_MIN_BYTES)  # freed together, tens of slices unmapped or trimmed at once
    pieces.clear()
    return data


def _idat(pieces: list, data: bytes) -> None:
    if data:
        pieces += (struct.pack(">I", len(data)) + b"IDAT", data, struct.pack(">I", zlib.crc32(data, _IDAT_CRC)))
