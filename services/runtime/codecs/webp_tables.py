"""What libwebp's lossless decoder may hold besides the pixels: its Huffman tables.

A lossless picture (a VP8L chunk, the lossless alpha of a lossy one, an animation's frame)
names, through its entropy image, up to 65 536 groups of five Huffman codes, and the decoder
builds the tables of every group it names (below 1 000, of every group up to the highest one
named): about 20 KB a group at the largest colour cache (5 004 four-byte entries, and the
group's own 568 bytes), whatever the pixel count. A 1024x1024 picture of 18 MB held
1.25 GB to decode while it was charged 23 MB (helper-45: sixteen clients sending it took the
unit down, 137). The groups are read from the entropy image (vp8l_groups: an ordinary photo
names tens); where it cannot be followed, a picture is charged the most it may name: no more
than its entropy image has cells (one per 4x4 block at the finest; 1 000 for a small
picture), nor than its bytes can describe (five codes of four bits at least each), nor
65 536 (that charge refused every lossless photo of a megapixel, helper-50). A still picture's lossless
stream is read to the end of the file, whatever its chunk's size says (helper-47 wrapped the
bomb in a chunk of 78 bytes): its bytes are counted from the chunk to the file's end.
"""

from __future__ import annotations

import time

from services.runtime.codecs.vp8l_groups import PARSE_BUDGET, StreamError, built_groups, vp8l_groups
from services.runtime.codecs.webp_header import MAX_CHUNKS, iter_chunks, riff_end

GROUP_BYTES = 5004 * 4 + 568  # kTableSize at colour cache bits 11 (HuffmanCode: 4 bytes), HTreeGroup
MAX_GROUPS = 1 << 16        # a meta code is the entropy image's red and green: 16 bits
ALL_GROUPS_UNDER = 1000     # libwebp builds every group up to the highest one named, below this
MIN_GROUP_BITS = 20         # five codes, each at least 4 bits
CELL_SIDE = 4               # the entropy image's finest cell (huffman bits 2)
ARGB_BYTES = 4              # the lossless decoder's own ARGB buffer, a pixel
# a picture with alpha is decoded to BGRA, then BGR (and a lossy one's alpha plane besides):
# 3000x3000 held 8.0 (lossless) and 9.0 (lossy) bytes a pixel where 7.0 were charged
ALPHA_BYTES = 2


def lossless_table_bytes(data: bytes, width: int, height: int) -> int:
    """The most a WebP's decoder may hold at once besides the picture: its lossless parts'
    Huffman tables and ARGB buffer, and ALPHA_BYTES a pixel for a picture with alpha (0 for a
    lossy picture without alpha). An
    animation's frames are decoded one by one, each with its own tables: the largest part
    bounds them. A part's groups are read from its entropy image (vp8l_groups); where that
    cannot be followed, they are the most its cells and bytes allow."""
    parts, alpha = _lossless_parts(data, width, height)
    alpha = alpha or _says_alpha(data)
    extra = ALPHA_BYTES * width * height if alpha else 0
    if not parts:
        return extra
    groups = max(_groups(data, part, width, height) for part in parts)
    return groups * GROUP_BYTES + ARGB_BYTES * width * height + extra


def _says_alpha(data: bytes) -> bool:
    """VP8X's alpha flag, or a top-level VP8L stream's alpha bit (a picture decoded with alpha)."""
    if data[12:16] == b"VP8X" and len(data) > 20:
        return bool(data[20] & 0x10)
    if data[12:16] == b"VP8L" and len(data) >= 25:
        return bool(int.from_bytes(data[21:25], "little") >> 28 & 1)
    return False


def most_groups(width: int, height: int, size: int) -> int:
    """The most groups a lossless stream of `size` bytes may make libwebp build."""
    cells = -(-width // CELL_SIDE) * -(-height // CELL_SIDE)
    # below ALL_GROUPS_UNDER, every group up to the highest index is built, however few cells
    named = max(cells, min(ALL_GROUPS_UNDER, width * height))
    return min(MAX_GROUPS, named, size * 8 // MIN_GROUP_BITS + 1)


def _groups(data: bytes, part: tuple[bytes, int, int, int, int], width: int, height: int) -> int:
    kind, start, end, part_width, part_height = part
    if kind == b"" or not PARSE_BUDGET.take():  # a walk that did not add up; or no time to read now
        return most_groups(width, height, end - start)
    spent = time.thread_time()
    try:
        if kind == b"VP8L":
            return vp8l_groups(data, start, end)[0]
        return built_groups(data, start + 1, end, part_width, part_height)  # after the ALPH byte
    except (StreamError, IndexError, ValueError):
        return most_groups(width, height, end - start)
    finally:
        PARSE_BUDGET.pay(time.thread_time() - spent)


def _lossless_parts(data: bytes, width: int, height: int) -> tuple[list[tuple[bytes, int, int, int, int]], bool]:
    """Each lossless part (VP8L or lossless ALPH chunk: its kind, where its stream starts and
    ends, its size), and whether the picture has an alpha chunk. A top-level part's stream
    counts to the end of the file (a still picture's lossless stream is read to the end of
    the buffer, whatever its chunk's size says), an animation frame's to the end of its
    frame; chunks are looked for up to the RIFF's end, as libwebp does (stray bytes after a
    lossy picture made it a lossless bomb). The whole file as one part that cannot be followed
    for a walk that does not add up (charged the most it may name: the safe side)."""
    try:
        alpha, parts = [False], []
        if not _walk(data, 12, riff_end(data), (width, height), alpha, parts):
            raise ValueError("the walk does not add up")
        return parts, alpha[0]
    except Exception:  # noqa: BLE001 - any surprise in the walk: the most it could be
        return [(b"", 0, len(data), width, height)], True


def _walk(data: bytes, at: int, end: int, size: tuple[int, int], alpha: list[bool],
          parts: list[tuple[bytes, int, int, int, int]], top: bool = True) -> bool:
    for seen, (fourcc, body, length) in enumerate(iter_chunks(data, at, end), 1):
        # (past MAX_CHUNKS, here a frame's own chunks: the most it could be; a last chunk's pad
        # byte may be missing)
        if seen > MAX_CHUNKS or body + length > end + 1:
            return False
        if fourcc == b"ALPH":
            alpha[0] = True
        if fourcc == b"VP8L" or (fourcc == b"ALPH" and length and data[body] & 0x03 == 1):
            parts.append((fourcc, body, len(data) if top else end, *size))
        elif fourcc == b"ANMF" and top:  # (frames hold no frames)
            frame = (1 + int.from_bytes(data[body + 6:body + 9], "little"),
                     1 + int.from_bytes(data[body + 9:body + 12], "little"))
            if not _walk(data, body + 16, body + length, frame, alpha, parts, False):
                return False
    return True
