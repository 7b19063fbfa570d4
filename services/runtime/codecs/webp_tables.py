"""What libwebp's lossless decoder may hold besides the pixels: its Huffman tables.

A lossless picture (a VP8L chunk, the lossless alpha of a lossy one, an animation's frame)
names, through its entropy image, up to 65 536 groups of five Huffman codes, and the decoder
builds the tables of every group it names: about 20 KB a group at the largest colour cache
(5 002 four-byte entries), whatever the pixel count. A 1024x1024 picture of 18 MB held
1.25 GB to decode while it was charged 23 MB (helper-45: sixteen clients sending it took the
unit down, 137). The groups cannot be counted without decoding the transforms' sub-images
before them, so a picture is charged the most it may name: no more than its entropy image
has cells (one per 4x4 block at the finest), nor than its bytes can describe (five codes of
four bits at least each), nor 65 536.
"""

from __future__ import annotations

import struct

GROUP_BYTES = 5002 * 4 + 256  # kTableSize at colour cache bits 11 (HuffmanCode: 4 bytes), the group itself
MAX_GROUPS = 1 << 16        # a meta code is the entropy image's red and green: 16 bits
MIN_GROUP_BITS = 20         # five codes, each at least 4 bits
CELL_SIDE = 4               # the entropy image's finest cell (huffman bits 2)
MAX_CHUNKS = 4096           # a walk longer than this is taken for lossless (the charge is the bound)


def lossless_table_bytes(data: bytes, width: int, height: int) -> int:
    """The most a WebP's lossless parts may make the decoder hold in Huffman tables at once (0
    for a lossy picture without lossless alpha). An animation's frames are decoded one by one,
    each with its own tables: the largest lossless chunk bounds them."""
    largest = _largest_lossless(data)
    if not largest:
        return 0
    cells = -(-width // CELL_SIDE) * -(-height // CELL_SIDE)
    groups = min(MAX_GROUPS, cells, largest * 8 // MIN_GROUP_BITS + 1)
    return groups * GROUP_BYTES


def _largest_lossless(data: bytes) -> int:
    """The size of the largest VP8L chunk, or ALPH chunk compressed losslessly, at the top or
    in an animation's frames; the whole file for a chunk walk that does not add up (charged
    as lossless: the safe side)."""
    try:
        return _walk(data, 12, len(data), [0])
    except (struct.error, IndexError):
        return len(data)


def _walk(data: bytes, at: int, end: int, seen: list[int]) -> int:
    largest = 0
    while at + 8 <= end:
        fourcc, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = at + 8
        seen[0] += 1
        if seen[0] > MAX_CHUNKS or body + size > end + 1:  # (a last chunk's pad byte may be missing)
            return len(data)
        if fourcc == b"VP8L" or (fourcc == b"ALPH" and size and data[body] & 0x03 == 1):
            largest = max(largest, size)
        elif fourcc == b"ANMF":
            largest = max(largest, _walk(data, body + 16, body + size, seen))
        at = body + size + (size & 1)
    return largest
