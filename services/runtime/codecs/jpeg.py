"""A cheap walk over a JPEG's markers, before any decoder sees it.

Decode cost is not bounded by the pixel count alone: a progressive JPEG may carry
thousands of scans, and libjpeg re-runs the whole image for each one (a 450 KB file
can hold a decoder for minutes). Neither Pillow nor OpenCV limits scans by default.
This walk counts segments and scans without decoding anything: header segments are
skipped by their length, entropy-coded data is skipped by a search for the next marker:
a regex for a short span, numpy over a long one (it leaves the GIL free: the regex held it
3.6 ms over a 12 MB photo's scan, and img2img's /healthz p99 was 24-26 ms under 5 such
job submits a second).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

SOI, EOI, SOS = 0xD8, 0xD9, 0xDA
# A marker after entropy-coded data: 0xFF followed by anything but a stuffed 0x00,
# a restart marker (D0-D7) or fill bytes.
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}
NUMPY_MIN_BYTES = 1 << 20   # spans longer than this are searched with numpy
WINDOW_BYTES = 4 << 20      # a window at a time: the search stops at the first marker
_FILL_BLOCK = b"\xff" * (1 << 16)


# APP1 "Exif" and APP2 "MPF" blocks are TIFF structures that Pillow parses tag by tag in
# Python when it opens the file (GIL held: a 64 KB block of overlapping tags took 15 ms a
# picture, and eight at once kept the probes waiting 30 ms).
_TIFF_BLOCKS = ((0xE1, b"Exif\x00\x00"), (0xE2, b"MPF\x00"))
APP15 = 0xEF


@dataclass(frozen=True)
class JpegShape:
    scans: int
    markers: int
    progressive: bool
    # where the header ends (after the first scan's header; the data's length without one),
    # the markers of its TIFF blocks, and the first EXIF block's bytes ("Exif\0\0" and all)
    header_end: int = field(default=0, compare=False)
    tiff_markers: tuple[int, ...] = field(default=(), compare=False)
    exif: bytes | None = field(default=None, compare=False)
    # (start, end) of the extraneous and fill bytes skipped before the header's end
    junk: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    # what libjpeg's whole-image coefficient buffer holds, where it keeps one (a progressive
    # picture, or one whose components come in separate scans): 2 bytes a coefficient for
    # every block of every component, at full size even when decoded at a reduced scale
    coefficient_bytes: int = field(default=0, compare=False)


class JpegLimitError(Exception):
    def __init__(self, what: str, count: int, limit: int):
        super().__init__(f"{what}: {count} is over the limit of {limit}")
        self.what, self.count, self.limit = what, count, limit


def walk(data: bytes, max_scans: int, max_markers: int, header_only: bool = False) -> JpegShape:
    """Count scans and segments; raise JpegLimitError as soon as one is over its limit.
    A malformed structure just ends the walk: the decoder reports corruption itself.
    ``header_only``: stop at the first scan (what Pillow reads to know the format and size)."""
    n = len(data)
    if data[:2] != bytes((0xFF, SOI)):  # not a JPEG: nothing to walk
        return JpegShape(0, 0, False)
    pos, scans, markers, progressive = 2, 0, 0, False
    header_end, tiff, exif, junk, coefficients = 0, [], None, [], 0
    frame_components = first_scan_components = 0
    while pos + 4 <= n:
        if data[pos] != 0xFF or data[pos + 1] == 0x00:
            # Extraneous bytes before a marker (0xFF00 among them): libjpeg skips them (a
            # warning) and decodes the rest, Pillow skips them too. Stopping here hid every
            # scan after a junk byte from the limits.
            found = next_marker(data, pos + 1)
            end = n if found < 0 else found
            # (Pillow refuses a file whose SOI no 0xFF follows at once: it still sees that one.
            # Junk with no marker after it is cut too: Pillow stepped through 15 MB of it in 1.4 s.)
            if not header_end and (pos > 2 or data[2] == 0xFF):
                junk.append((pos, end))
            if found < 0:
                break
            pos = end
            continue
        marker = data[pos + 1]
        if marker == 0xFF:
            # Fill bytes before a marker, any number of them (B.1.1.2): skipped a block at a
            # time, not a byte at a time (20 MB of them took this walk 2.8 s), and cut from the
            # header Pillow reads, which steps through them a byte at a time too.
            end = _fill_end(data, pos + 2) - 1  # the last 0xFF is the marker's own
            if not header_end:
                junk.append((pos, end))
            if end + 1 >= n:
                break
            pos = end
            continue
        if marker == EOI:
            break
        pos += 2
        markers += 1
        if markers > max_markers:
            raise JpegLimitError("JPEG segments", markers, max_markers)
        if marker in _STANDALONE:
            continue
        length = (data[pos] << 8) | data[pos + 1]
        if length < 2:
            break
        if marker in (0xC2, 0xC6, 0xCA, 0xCE):  # SOF2/6/10/14: progressive
            progressive = True
        if marker in _SOF and not coefficients:
            coefficients = _coefficient_bytes(data[pos + 2:pos + length])
            frame_components = data[pos + 7] if pos + 7 < n else 0
        if marker == SOS and not first_scan_components and pos + 2 < n:
            first_scan_components = data[pos + 2]
        if not header_end:
            for app, tag in _TIFF_BLOCKS:
                if marker == app and data.startswith(tag, pos + 2):
                    tiff.append(pos - 1)
                    if app == 0xE1 and exif is None:
                        exif = bytes(data[pos + 2:pos + length])
        pos += length
        if marker == SOS:
            header_end = header_end or min(pos, n)
            scans += 1
            if scans > max_scans:
                raise JpegLimitError("JPEG scans", scans, max_scans)
            if header_only:
                break
            pos = next_marker(data, pos)
            if pos < 0:
                break
    # libjpeg keeps the whole image's coefficients for a progressive picture and for one whose
    # first scan does not carry every component (the others come in later scans: a single scan
    # of one component of three, 166 bytes arithmetic-coded, held them all)
    buffered = progressive or scans > 1 or first_scan_components < frame_components
    return JpegShape(scans, markers, progressive, header_end or n, tuple(tiff), exif, tuple(junk),
                     coefficients if buffered else 0)


def next_marker(data: bytes, pos: int) -> int:
    """Where the first marker at or after `pos` is (0xFF then a byte that is not 0x00, a
    restart marker or 0xFF), or -1."""
    n = len(data)
    if n - pos < NUMPY_MIN_BYTES:
        m = _NEXT_MARKER.search(data, pos)
        return -1 if m is None else m.start()
    array = np.frombuffer(data, np.uint8)
    for start in range(pos, n - 1, WINDOW_BYTES):
        end = min(n - 1, start + WINDOW_BYTES)  # (each 0xFF found has its next byte within the data)
        ff = np.flatnonzero(array[start:end] == 0xFF) + start
        if ff.size:
            after = array[ff + 1]
            hit = np.flatnonzero((after != 0x00) & (after != 0xFF) & ((after < 0xD0) | (after > 0xD7)))
            if hit.size:
                return int(ff[hit[0]])
    return -1


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC share the range


def _coefficient_bytes(sof: bytes) -> int:
    """A frame header's coefficient buffer: each component's blocks, padded to whole MCUs
    (libjpeg's jdcoefct: width_in_blocks rounded up to the component's sampling factor), 64
    coefficients of 2 bytes each. 0 for a header too short to say."""
    if len(sof) < 6:
        return 0
    height, width, count = (sof[1] << 8) | sof[2], (sof[3] << 8) | sof[4], sof[5]
    factors = [(sof[6 + 3 * i + 1] >> 4, sof[6 + 3 * i + 1] & 0x0F) for i in range(count) if 6 + 3 * i + 2 < len(sof)]
    if not factors or not height or not width:
        return 0
    hmax, vmax = max(max(h for h, _ in factors), 1), max(max(v for _, v in factors), 1)
    mcus_x, mcus_y = -(-width // (8 * hmax)), -(-height // (8 * vmax))
    return sum(mcus_x * max(h, 1) * mcus_y * max(v, 1) for h, v in factors) * 64 * 2


def _fill_end(data: bytes, pos: int) -> int:
    """The first index from ``pos`` on whose byte is not 0xFF, else len(data): blocks compared
    whole (memcmp speed: 3 ms for 20 MB; a regex search took 140 ms with the GIL held),
    growing from 64 bytes so that the usual one or two fill bytes cost little."""
    n, step = len(data), 64
    while pos < n:
        window = data[pos:pos + step]
        if window != (_FILL_BLOCK if len(window) == len(_FILL_BLOCK) else _FILL_BLOCK[:len(window)]):
            return pos + len(window) - len(window.lstrip(b"\xff"))
        pos += len(window)
        step = min(2 * step, len(_FILL_BLOCK))
    return n


def header_for_pillow(data: bytes, shape: JpegShape) -> bytes:
    """What Pillow needs to read a JPEG's format and size: the header up to the first scan,
    with its EXIF and MPF blocks renamed APP15, which Pillow keeps as they are instead of
    parsing every tag (the orientation is read by services.runtime.codecs.exif, in bounds),
    and without the extraneous bytes between its segments, which Pillow skips a byte at a
    time in Python (36 ns a byte, with the GIL held: 0.7 s for a 20 MB body of them)."""
    if not shape.tiff_markers and not shape.junk:
        return data
    if shape.tiff_markers:
        head = bytearray(data[:shape.header_end])
        for at in shape.tiff_markers:
            head[at] = APP15
        if not shape.junk:
            return bytes(head)
        view = memoryview(head)
    else:
        view = memoryview(data)[:shape.header_end]
    # the kept stretches joined once: deleting each run in place moved the rest of the header
    # every time (quadratic: 250 fill runs before 16 MB of segments took 87 ms)
    kept, at = [], 0
    for start, end in shape.junk:  # in order, apart
        kept.append(view[at:start])
        at = max(at, end)
    kept.append(view[at:])
    return b"".join(kept)
