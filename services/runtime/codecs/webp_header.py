"""A WebP's size, animation flag and metadata, read from its chunks without Pillow.

Pillow's WebP plugin opens a file by reading it whole into a new string and handing that to
libwebp's animation decoder: two copies of the file and a demux, all holding the GIL (an
18 MB picture: 6-24 ms each time). Eight clients resending such a file, refused at once for
its cost, kept detect's /healthz p99 at 178-293 ms while the CPU pool's threads probed them.
This reads the RIFF header, the first image chunk's frame header (or VP8X's canvas) and the
first EXIF and XMP chunks: microseconds, whatever the file's size. What it does not check
(the bitstream itself) the decoder refuses later, as a corrupt picture.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

# more chunks than this (an animation's frames among them) is refused: libwebp's demuxer, which
# OpenCV runs on every WebP, keeps about 32 bytes for each (2.5 million empty chunks in 19 MB
# held 78 MiB for a picture of one pixel)
MAX_CHUNKS = 4096
# metadata is read up to this much and one byte more: a bigger block is not looked into (its
# readers refuse it by its size), and is never copied whole
MAX_METADATA_BYTES = 1 << 20


class WebpHeaderError(ValueError):
    """Not a WebP this reader can size."""


class WebpLimitError(ValueError):
    """A WebP whose structure would cost too much to decode."""


@dataclass(frozen=True)
class WebpHeader:
    width: int
    height: int
    animated: bool
    exif: bytes | None
    xmp: bytes | None


def is_webp(data: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def riff_end(data: bytes) -> int:
    """Where the file's chunks end: libwebp reads none past the RIFF's own end (what follows
    is not the picture's)."""
    return min(len(data), 8 + struct.unpack_from("<I", data, 4)[0])


def iter_chunks(data: bytes, at: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(fourcc, where its body starts, its size) of each chunk from `at` to `end`, stepping
    over the pad byte of an odd size. A size is as the file says: the caller checks it."""
    while at + 8 <= end:
        fourcc, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        yield fourcc, at + 8, size
        at += 8 + size + (size & 1)


def read_header(data: bytes) -> WebpHeader:
    if len(data) < 20 or not is_webp(data):
        raise WebpHeaderError("not a WebP file")
    end = riff_end(data)
    fourcc, size = data[12:16], struct.unpack_from("<I", data, 16)[0]
    body = data[20:20 + min(size, 16)]  # (a slice copies: only the frame header's bytes)
    flags = body[0] if fourcc == b"VP8X" and body else 0
    exif, xmp, image = _chunks(data, 12, end, flags)
    if fourcc == b"VP8 ":
        if len(body) < 10 or body[3:6] != b"\x9d\x01\x2a":
            raise WebpHeaderError("the lossy frame header is corrupt")
        width, height = (struct.unpack_from("<H", body, 6)[0] & 0x3FFF, struct.unpack_from("<H", body, 8)[0] & 0x3FFF)
        return _sized(width, height, False, exif, xmp)
    if fourcc == b"VP8L":
        if len(body) < 5 or body[0] != 0x2F:
            raise WebpHeaderError("the lossless header is corrupt")
        bits = struct.unpack_from("<I", body, 1)[0]
        return _sized((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, False, exif, xmp)
    if fourcc == b"VP8X":
        if len(body) < 10:
            raise WebpHeaderError("the extended header is corrupt")
        width = int.from_bytes(body[4:7], "little") + 1
        height = int.from_bytes(body[7:10], "little") + 1
        if not image:
            raise WebpHeaderError("no image in the file")
        return _sized(width, height, bool(flags & 0x02), exif, xmp)
    raise WebpHeaderError(f"unknown first chunk {fourcc!r}")


def _sized(width: int, height: int, animated: bool, exif: bytes | None, xmp: bytes | None) -> WebpHeader:
    if width <= 0 or height <= 0:
        raise WebpHeaderError("the image has no pixels")
    return WebpHeader(width, height, animated, exif, xmp)


def _chunks(data: bytes, at: int, end: int, flags: int) -> tuple[bytes | None, bytes | None, bool]:
    """The first EXIF and XMP chunks (only where VP8X's flags say the file has them, as libwebp
    and Pillow read them; a simple file has none), and whether an image chunk is there.
    WebpLimitError past MAX_CHUNKS chunks."""
    exif = xmp = None
    image = False
    for count, (fourcc, body, size) in enumerate(iter_chunks(data, at, end), 1):
        if count > MAX_CHUNKS:
            raise WebpLimitError(f"WebP chunks: more than {MAX_CHUNKS}")
        kept = body + min(size, MAX_METADATA_BYTES + 1)
        if fourcc == b"EXIF" and exif is None and flags & 0x08:
            exif = bytes(data[body:kept])
        elif fourcc == b"XMP " and xmp is None and flags & 0x04:
            xmp = bytes(data[body:kept])
        elif fourcc in (b"VP8 ", b"VP8L", b"ANMF"):
            image = True
    return exif, xmp, image
