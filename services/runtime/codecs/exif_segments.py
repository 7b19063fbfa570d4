"""An EXIF block put into a JPEG or WebP answer, as Pillow and libwebp's muxer write it.

The answer is not concatenated with it (each ``+`` a copy of the whole answer with the GIL
held): the pieces are handed back as views, for one copy a slice at a time
(fresh_bytes.joined)."""

from __future__ import annotations

import io
import struct

from PIL import Image

EXIF_HEADER = b"Exif\x00\x00"
MAX_JPEG_SEGMENT = 65533   # a JPEG segment's length field counts itself: 65535 in all


def tiff_of(exif: bytes) -> bytes:
    """The TIFF structure of an EXIF block, with or without its "Exif\\0\\0" header."""
    return exif[len(EXIF_HEADER):] if exif.startswith(EXIF_HEADER) else exif


def jpeg_pieces(jpeg: bytes, exif: bytes) -> list[bytes | memoryview]:
    """The JPEG with an APP1 EXIF segment after its JFIF header (right after the start of image
    when there is none), as pieces."""
    if jpeg[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG stream")
    body = EXIF_HEADER + tiff_of(exif)
    if len(body) > MAX_JPEG_SEGMENT:
        raise ValueError(f"an EXIF block of {len(body)} bytes does not fit a JPEG segment (64 KiB)")
    at = 2
    if jpeg[2:4] == b"\xff\xe0":
        at = 4 + struct.unpack(">H", jpeg[4:6])[0]
    view = memoryview(jpeg)
    return [view[:at], b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body, view[at:]]


def webp_pieces(webp: bytes, exif: bytes) -> list[bytes | memoryview]:
    """A simple (VP8 or VP8L) WebP with an EXIF chunk added, and a VP8X header announcing it,
    as pieces. An extended WebP (one that has a VP8X header already) is returned as it is."""
    kind = webp[12:16]
    if webp[:4] != b"RIFF" or webp[8:12] != b"WEBP" or kind not in (b"VP8 ", b"VP8L"):
        return [webp]
    with Image.open(io.BytesIO(webp), formats=("WEBP",)) as im:
        width, height = im.size
    vp8x = bytes([0x08, 0, 0, 0]) + struct.pack("<I", width - 1)[:3] + struct.pack("<I", height - 1)[:3]
    tail = _chunk(b"EXIF", tiff_of(exif))
    head = b"WEBP" + _chunk(b"VP8X", vp8x)
    size = len(head) + len(webp) - 12 + len(tail)
    return [b"RIFF" + struct.pack("<I", size) + head, memoryview(webp)[12:], tail]


def _chunk(name: bytes, data: bytes) -> bytes:
    return name + struct.pack("<I", len(data)) + data + (b"\x00" if len(data) & 1 else b"")
