"""A picture's EXIF orientation is read within bounds, by services.runtime.codecs.exif, and
Pillow never parses an EXIF or MPF block tag by tag in Python while the picture is probed
(a 64 KB block of overlapping tags held the GIL for 15 ms a picture)."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image

from services.runtime.codecs import exif
from services.runtime.codecs.images import DecodeLimits, probe_image
from tests import images as I

LIMITS = DecodeLimits(max_pixels=100_000_000)


def picture(fmt: str, orientation: int | None, size=(30, 20)) -> bytes:
    im = Image.fromarray(np.zeros((size[1], size[0], 3), np.uint8))
    buf = io.BytesIO()
    if orientation is None:
        im.save(buf, fmt)
    else:
        tags = Image.Exif()
        tags[0x0112] = orientation
        im.save(buf, fmt, exif=tags.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", [None, *range(1, 9)])
def test_the_orientation_is_pillows_and_the_size_follows_it(fmt, orientation):
    data = picture(fmt, orientation)
    header = probe_image(data, LIMITS)
    assert header.orientation == (Image.open(io.BytesIO(data)).getexif().get(0x0112) or 1) == (orientation or 1)
    assert (header.width, header.height) == ((20, 30) if orientation in (5, 6, 7, 8) else (30, 20))
    assert header.format == fmt


def tiff(order: str, entries: list[tuple[int, int, int, bytes]], ifd: int = 8) -> bytes:
    head = (b"II*\x00" if order == "<" else b"MM\x00*") + struct.pack(order + "I", ifd)
    body = struct.pack(order + "H", len(entries)) + b"".join(
        struct.pack(order + "HHI", t, k, n) + v.ljust(4, b"\x00") for t, k, n, v in entries)
    return head + b"\x00" * (ifd - 8) + body


@pytest.mark.parametrize("order", ["<", ">"])
def test_short_and_long_values_in_either_byte_order(order):
    assert exif.orientation(tiff(order, [(0x0110, 2, 4, b"abc"), (0x0112, 3, 1, struct.pack(order + "H", 6))])) == 6
    assert exif.orientation(b"Exif\x00\x00" + tiff(order, [(0x0112, 4, 1, struct.pack(order + "I", 8))])) == 8


@pytest.mark.parametrize("block", [
    None, b"", b"Exif\x00\x00", b"II*\x00", b"XX*\x00\x08\x00\x00\x00",
    tiff("<", [(0x0112, 3, 1, struct.pack("<H", 9))]),            # out of range
    tiff("<", [(0x0112, 3, 1, struct.pack("<H", 0))]),
    tiff("<", [(0x0112, 3, 2, struct.pack("<HH", 6, 6))]),        # two values
    tiff("<", [(0x0112, 2, 1, b"6")]),                            # ASCII
    tiff("<", [(0x0112, 3, 1, struct.pack("<H", 6))])[:-6],       # cut inside the entry
    b"II*\x00" + struct.pack("<I", 4) + b"\x01\x00",              # the IFD inside the header
    b"II*\x00" + struct.pack("<I", 1 << 30),                      # the IFD past the end
])
def test_a_missing_or_malformed_block_is_orientation_1(block):
    assert exif.orientation(block) == 1


def test_only_the_first_entries_of_a_huge_ifd_are_looked_at():
    filler = [(0x0100 + (i % 8), 3, 1, b"\x01\x00") for i in range(exif.MAX_IFD_ENTRIES)]
    assert exif.orientation(tiff("<", [*filler[:10], (0x0112, 3, 1, b"\x06\x00")])) == 6
    assert exif.orientation(tiff("<", [*filler, (0x0112, 3, 1, b"\x06\x00")])) == 1


@pytest.mark.parametrize("data", [I.exif_bomb_jpeg(), picture("JPEG", 6), I.exif_bomb_png(), picture("PNG", 3)],
                         ids=["jpeg bomb", "jpeg", "png bomb", "png"])
def test_pillow_never_parses_exif_or_mpf_tags_while_probing(monkeypatch, data):
    from PIL import Image as PilImage
    from PIL import TiffImagePlugin

    def refuse(*a, **k):
        raise AssertionError("Pillow parsed a TIFF block while probing")
    monkeypatch.setattr(TiffImagePlugin.ImageFileDirectory_v2, "load", refuse)
    monkeypatch.setattr(PilImage.Exif, "load", refuse)
    header = probe_image(data, LIMITS)
    assert header.width > 0 and header.height > 0


def test_an_mpo_style_jpeg_is_probed_as_a_jpeg():
    base = picture("JPEG", None)
    mpf = b"MPF\x00" + tiff(">", [(0xB000, 7, 4, b"0100")])
    data = base[:2] + b"\xff\xe2" + struct.pack(">H", len(mpf) + 2) + mpf + base[2:]
    header = probe_image(data, LIMITS)
    assert (header.format, header.width, header.height) == ("JPEG", 30, 20)
