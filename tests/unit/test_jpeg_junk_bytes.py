"""Bytes between a JPEG's segments that are not a marker ("Corrupt JPEG data: N extraneous bytes
before marker"): libjpeg skips them and decodes the rest, and Pillow skips them too. The walk
that bounds a JPEG's decode cost and finds its EXIF block must skip them as well: a few junk
bytes after the first segment once hid every scan and segment after them (a scan bomb then
passed the scan limit) and the EXIF block (Pillow parsed it tag by tag again, and the
orientation was lost). Pillow is shown the header without them: it skips junk a byte at a
time in Python, with the GIL held (36 ns a byte: 0.7 s for a 20 MB body)."""

from __future__ import annotations

import io
import struct

import cv2
import numpy as np
import pytest
from PIL import Image

from services.runtime.codecs import jpeg
from services.runtime.codecs.images import DecodeLimits, probe_image
from services.runtime.errors import ApiError
from tests import images as I


def with_junk(data: bytes, junk: bytes) -> bytes:
    """`junk` after the first segment (the encoder's APP0)."""
    assert data[2:4] == b"\xff\xe0"
    end = 4 + struct.unpack(">H", data[4:6])[0]
    return data[:end] + junk + data[end:]


def exif_segment(orientation: int) -> bytes:
    tags = Image.Exif()
    tags[0x0112] = orientation
    block = tags.tobytes()  # the TIFF block behind its Exif prefix
    return b"\xff\xe1" + struct.pack(">H", len(block) + 2) + block


JUNK = [b"\x00", b"\x12\x34\x56", b"\x00\xff\x00", b"\xff\x00\x00"]


@pytest.mark.parametrize("junk", JUNK)
def test_junk_between_segments_hides_no_scan_from_the_limit(junk):
    data = with_junk(I.progressive_jpeg(), junk)
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert decoded is not None  # libjpeg decodes it, every scan
    scans = jpeg.walk(I.progressive_jpeg(), 1000, 1000).scans
    assert scans > 2 and jpeg.walk(data, 1000, 1000).scans == scans
    with pytest.raises(ApiError) as err:
        probe_image(data, DecodeLimits(max_pixels=10**8, max_jpeg_scans=scans - 1))
    assert (err.value.status, err.value.code) == (413, "image_too_complex")


@pytest.mark.parametrize("junk", JUNK)
def test_an_exif_block_after_junk_is_read_in_bounds_as_pillow_reads_it(monkeypatch, junk):
    base = I.progressive_jpeg()
    data = with_junk(base, junk + exif_segment(6))
    assert Image.open(io.BytesIO(data)).getexif().get(0x0112) == 6
    from PIL import TiffImagePlugin

    def refuse(*a, **k):
        raise AssertionError("Pillow parsed a TIFF block while probing")
    monkeypatch.setattr(TiffImagePlugin.ImageFileDirectory_v2, "load", refuse)
    monkeypatch.setattr(Image.Exif, "load", refuse)
    header = probe_image(data, DecodeLimits(max_pixels=10**8))
    w, h = Image.open(io.BytesIO(base)).size
    assert (header.format, header.width, header.height, header.orientation) == ("JPEG", h, w, 6)


def test_pillow_is_shown_the_header_without_the_junk(pillow_reads):
    data = with_junk(I.progressive_jpeg(), b"\x00" * (1 << 20))
    size = Image.open(io.BytesIO(data)).size
    pillow_reads.clear()
    header = probe_image(data, DecodeLimits(max_pixels=10**8))
    assert (header.format, header.width, header.height) == ("JPEG", *size)
    assert pillow_reads and max(pillow_reads) < 64 * 1024  # the header's segments, not the megabyte of junk


def test_junk_right_after_the_start_of_image_is_still_refused_as_pillow_refuses_it():
    base = I.progressive_jpeg()
    with pytest.raises(ApiError) as err:
        probe_image(base[:2] + b"\x00\x00" + base[2:], DecodeLimits(max_pixels=10**8))
    assert err.value.status in (400, 415)


@pytest.mark.parametrize("where", ["after the first segment", "right after the start of image"])
def test_fill_bytes_are_skipped_whole_and_pillow_is_shown_the_header_without_them(pillow_reads, where):
    """Any number of fill bytes (0xFF) may come before a marker (T.81 B.1.1.2)."""
    base = I.progressive_jpeg()
    n = 4 << 20
    data = with_junk(base, b"\xff" * n) if where != "right after the start of image" else \
        base[:2] + b"\xff" * n + base[2:]
    size = Image.open(io.BytesIO(base)).size
    assert cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR).shape[:2] == size[::-1]
    shape = jpeg.walk(data, 1000, 1000)
    assert shape == jpeg.walk(base, 1000, 1000)  # the same segments and scans
    assert sum(end - start for start, end in shape.junk) >= n
    # one run is one step of the walk, not one per byte: the byte-at-a-time walk read each one
    assert _count_index_reads(data) < 1000
    pillow_reads.clear()
    header = probe_image(data, DecodeLimits(max_pixels=10**8))
    assert (header.format, header.width, header.height) == ("JPEG", *size)
    assert pillow_reads and max(pillow_reads) < 64 * 1024


@pytest.mark.parametrize("tail", [b"\xff" * (1 << 20), b"\xff" + b"\x00" * (1 << 20)])
def test_fill_and_junk_bytes_up_to_the_end_are_cut_too(tail):
    """With no marker after them Pillow refuses the file, after stepping through every byte."""
    data = b"\xff\xd8" + tail
    shape = jpeg.walk(data, 10, 10)
    assert len(jpeg.header_for_pillow(data, shape)) <= 4
    with pytest.raises(ApiError) as err:
        probe_image(data, DecodeLimits(max_pixels=10**8))
    assert err.value.status == 400


class _CountingBytes(bytes):
    """bytes that count how often the walk indexes one of them."""
    reads = 0

    def __getitem__(self, key):
        if isinstance(key, int):
            type(self).reads += 1
        return super().__getitem__(key)


def _count_index_reads(data: bytes) -> int:
    _CountingBytes.reads = 0
    jpeg.walk(_CountingBytes(data), 1000, 1000)
    return _CountingBytes.reads


def test_many_fill_runs_and_an_exif_block_all_come_out_of_pillows_header():
    base = I.progressive_jpeg()
    end = 4 + struct.unpack(">H", base[4:6])[0]
    segments = [exif_segment(3)] + [b"\xff\xfe" + struct.pack(">H", 6) + bytes([i, i, i, i]) for i in range(50)]
    filled = base[:end] + b"".join(b"\xff" * (i % 5 + 1) + seg for i, seg in enumerate(segments)) + base[end:]
    plain = base[:end] + b"".join(segments) + base[end:]
    shape = jpeg.walk(filled, 1000, 1000)
    assert len(shape.junk) == len(segments)  # one run before each: the last 0xFF of each is the marker's own
    expected = bytearray(plain[:jpeg.walk(plain, 1000, 1000).header_end])
    expected[end + 1] = jpeg.APP15  # the EXIF block renamed (its marker byte)
    assert jpeg.header_for_pillow(filled, shape) == bytes(expected)
    assert Image.open(io.BytesIO(jpeg.header_for_pillow(filled, shape))).size == Image.open(io.BytesIO(base)).size
