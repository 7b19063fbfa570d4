"""A picture's EXIF orientation, read within bounds.

Pillow parses every tag of an EXIF block in Python, with the GIL held, to answer one of
them: a 64 KB block of overlapping tags took 15 ms a picture and kept the probes waiting.
Orientation is tag 0x0112 of the first IFD; it is looked for among that IFD's first
MAX_IFD_ENTRIES entries (real ones hold a few dozen) by C-level unpacking, nothing else is
read, and anything malformed means orientation 1, as a broken block does for Pillow. When
the block has no orientation entry, Pillow takes it from the XMP packet: so does this.
"""

from __future__ import annotations

import re
import struct

MAX_IFD_ENTRIES = 1024
# a regex search of a packet: C speed, with the GIL held (a JPEG's XMP segment is at most 64 KB)
MAX_XMP_BYTES = 1 << 20
ORIENTATION = 0x0112
_SHORT, _LONG = 3, 4


def orientation(block: bytes | None) -> int:
    """1-8 from a TIFF-structured EXIF block (with or without its "Exif\\0\\0" prefix); 1 when
    there is none, it is malformed, or the value is out of range."""
    return orientation_entry(block) or 1


def orientation_entry(block: bytes | None) -> int | None:
    """The same, but None when the block holds no orientation entry (Pillow then looks in the
    picture's XMP packet: xmp_orientation)."""
    if not block:
        return None
    data = memoryview(block)
    if data[:6] == b"Exif\x00\x00":
        data = data[6:]
    order = {b"II*\x00": "<", b"MM\x00*": ">"}.get(bytes(data[:4]))
    if order is None or len(data) < 8:
        return None
    ifd = struct.unpack_from(order + "I", data, 4)[0]
    if ifd < 8 or ifd + 2 > len(data):
        return None
    count = min(struct.unpack_from(order + "H", data, ifd)[0], MAX_IFD_ENTRIES, (len(data) - ifd - 2) // 12)
    entries = data[ifd + 2:ifd + 2 + 12 * count]
    for tag, kind, n, value in struct.iter_unpack(order + "HHI4s", entries):
        if tag == ORIENTATION:
            if n != 1 or kind not in (_SHORT, _LONG):
                return 1
            got = struct.unpack_from(order + ("H" if kind == _SHORT else "I"), value)[0]
            return got if 1 <= got <= 8 else 1
    return None


# Pillow's own pattern (Image.getexif): the attribute form and the element form
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')


def xmp_orientation(packet: bytes | None) -> int:
    """1-8 from an XMP packet's tiff:Orientation, as Pillow reads it when the EXIF block has
    none; 1 when there is none, the packet is over MAX_XMP_BYTES, or the value is out of range."""
    if not isinstance(packet, bytes) or len(packet) > MAX_XMP_BYTES:
        return 1
    match = _XMP_ORIENTATION.search(packet)
    got = int(match[2]) if match else 1
    return got if 1 <= got <= 8 else 1
