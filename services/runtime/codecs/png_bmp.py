"""Cheap structure walks of PNG and BMP files, before any decoder sees them (JPEG: jpeg.py).

A decoder's cost is not bounded by the pixel count alone. A 19 MB PNG of 64x64 pixels can
carry 1.5 million empty chunks that a decoder walks one by one; a BMP may be RLE-compressed,
which Pillow decodes in pure Python (20 MB of RLE8 for two pixels took 7.5 s). A PNG's
compressed text (zTXt, iTXt) inflates about a thousandfold, and libpng keeps every chunk of
it, up to 8 MB each (500 chunks after the pixels, a 3.9 MB file: 3.9 GB in one decode), so
the walk notes where they are and the decoder is handed the file without them. These walks
read only chunk and header fields: a PNG's chunks are skipped by their length (counted: too
many tiny or ancillary chunks is a 413), a BMP's compression is read from its info header.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY_CHUNK = 256          # IDAT split this fine is not what any encoder writes
INFLATING_TEXT = (b"zTXt", b"iTXt")
# an ICC profile is compressed too: Pillow inflates every iCCP chunk it meets, up to 1 MB each
# and with no total (500 of them, a 0.5 MB file: 0.96 s of CPU a probe); the header needs none
ICC_PROFILE = b"iCCP"
# The chunks OpenCV's decoder needs for the pixels (its output ignores gamma, colour profiles,
# background and text: checked equal pixel for pixel without them). The rest are left out
# before it decodes: libpng inflates and keeps compressed text, and writes a line to stderr
# for each malformed ancillary chunk (500 in a 6.6 kB file: 500 lines of log a request).
DECODER_READS = (b"IHDR", b"PLTE", b"IDAT", b"IEND", b"tRNS", b"acTL", b"fcTL", b"fdAT")
# A photo's own few (pHYs, gAMA, cHRM, sRGB, eXIf, tIME, a tEXt or two) cost the decoder
# nothing worth a copy of the file: it is shown the file as it is.
FEW_UNNEEDED = 8
BMP_RLE = {1: "RLE8", 2: "RLE4"}
# Pillow takes a chunk type of four of these (its is_cid) and skips one it does not know: a
# walk that stopped at a digit would hand it what follows unwalked (uncounted chunks, iCCP)
_PILLOW_CHUNK_TYPE = re.compile(rb"[A-Za-z0-9_]{4}")


class FormatLimitError(Exception):
    def __init__(self, what: str, count: int, limit: int):
        super().__init__(f"{what}: {count} is over the limit of {limit}")


@dataclass(frozen=True)
class PngShape:
    chunks: int
    exif: bytes | None        # the eXIf chunk's content (a TIFF structure), if there is one
    animated: bool = False    # an acTL chunk: OpenCV composes the frames on a full canvas
    # (start, end) of each zTXt and iTXt chunk: text the pixels do not need, which a decoder
    # would inflate (a reader of the picture's metadata inflates them within its own bounds)
    inflating: tuple[tuple[int, int], ...] = ()
    first_idat: int | None = None   # where the image data starts: a reader of the header stops there
    profiles: tuple[tuple[int, int], ...] = ()   # (start, end) of each iCCP chunk
    unneeded: tuple[tuple[int, int], ...] = ()   # (start, end) of each chunk the decoder does not read


def walk_png(data: bytes, max_chunks: int, header_only: bool = False) -> PngShape:
    """Count chunks, find the eXIf chunk and an APNG's acTL; raise FormatLimitError when ancillary chunks or
    tiny image-data chunks pass `max_chunks`. A malformed structure ends the walk: the
    decoder reports it. (Pillow's own getexif() on a PNG whose eXIf chunk is not before the
    image data decodes the whole picture to look for one.) `header_only` stops at the image
    data, for a reader of the header alone: what follows is not its cost."""
    if not data.startswith(PNG_SIGNATURE):
        return PngShape(0, None)
    pos, n = len(PNG_SIGNATURE), len(data)
    ancillary = tiny = chunks = 0
    exif = None
    animated = False
    inflating: list[tuple[int, int]] = []
    first_idat = None
    profiles: list[tuple[int, int]] = []
    unneeded: list[tuple[int, int]] = []
    while pos + 8 <= n:
        length, kind = struct.unpack_from(">I4s", data, pos)
        if not _PILLOW_CHUNK_TYPE.fullmatch(kind):
            break  # past what even Pillow takes for a chunk type (libpng takes letters only): broken for both
        chunks += 1
        if kind == b"IDAT":
            if first_idat is None:
                first_idat = pos
            if header_only:
                break
            if length < TINY_CHUNK:
                tiny += 1
                if tiny > max_chunks:
                    raise FormatLimitError("PNG data chunks under 256 bytes", tiny, max_chunks)
        elif kind == b"IEND":
            break
        else:
            ancillary += 1
            if ancillary > max_chunks:
                raise FormatLimitError("PNG chunks", ancillary, max_chunks)
            if kind == b"eXIf" and exif is None:
                exif = data[pos + 8:pos + 8 + length]
            animated = animated or kind == b"acTL"
            if kind in INFLATING_TEXT:
                inflating.append((pos, min(n, pos + 12 + length)))
            elif kind == ICC_PROFILE:
                profiles.append((pos, min(n, pos + 12 + length)))
            if kind not in DECODER_READS:
                unneeded.append((pos, min(n, pos + 12 + length)))
        pos += 12 + length
    return PngShape(chunks, exif, animated, tuple(inflating), first_idat, tuple(profiles), tuple(unneeded))


def header_for_pillow(data: bytes, shape: PngShape) -> bytes | memoryview:
    """What Pillow reads to open a PNG (its chunks up to the image data), without the
    compressed text and ICC profiles: Pillow inflates each such chunk it meets on the way
    (text up to 64 MB a picture: 64 chunks of 1 MB in a 65 kB file cost 0.3-0.5 s of CPU a
    probe; profiles without a total). Opening a PNG reads no image data, so the copy stops
    at the first IDAT's chunk header."""
    before = sorted((start, end) for start, end in shape.inflating + shape.profiles
                    if shape.first_idat is None or start < shape.first_idat)
    if not before:
        return data
    end = len(data) if shape.first_idat is None else min(len(data), shape.first_idat + 8)
    return b"".join(without_spans(memoryview(data)[:end], tuple(before)))


def decoder_skips(shape: PngShape) -> tuple[tuple[int, int], ...]:
    """The chunks to leave out before the decoder: every one it does not read, when there is
    compressed text or a profile among them (libpng inflates those) or more than a few."""
    if shape.inflating or shape.profiles or len(shape.unneeded) > FEW_UNNEEDED:
        return shape.unneeded
    return ()


def unneeded_chunks(data: bytes) -> tuple[tuple[int, int], ...]:
    """decoder_skips for a picture whose walk was not kept."""
    try:
        return decoder_skips(walk_png(data, 1 << 62))
    except FormatLimitError:  # (no limit to pass)
        return ()


def spans_are_unneeded(data: bytes, spans: tuple[tuple[int, int], ...]) -> bool:
    return all(end <= len(data) and data[start + 4:start + 8] not in DECODER_READS
               and data[start + 4:start + 8].isalpha() for start, end in spans)


def without_spans(data: bytes, spans: tuple[tuple[int, int], ...]) -> list[memoryview]:
    """The pieces of `data` between `spans` (sorted, not overlapping), without copying."""
    view = memoryview(data)
    pieces, at = [], 0
    for start, end in spans:
        if start > at:
            pieces.append(view[at:start])
        at = end
    if at < len(data):
        pieces.append(view[at:])
    return pieces


def bmp_compression(data: bytes) -> str | None:
    """'RLE8' / 'RLE4' for a run-length encoded BMP, else None."""
    if len(data) < 34 or not data.startswith(b"BM"):
        return None
    header_size = struct.unpack_from("<I", data, 14)[0]
    if header_size < 40:  # OS/2 core header: never compressed
        return None
    return BMP_RLE.get(struct.unpack_from("<I", data, 30)[0])
