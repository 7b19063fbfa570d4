"""A WebP is sized from its chunks, as Pillow sizes it, without Pillow: its plugin copied the
whole file twice and built libwebp's demuxer holding the GIL (6-24 ms for 18 MB; eight
clients resending one kept detect's /healthz p99 at 178-293 ms)."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image, WebPImagePlugin

from services.runtime.codecs.images import DecodeLimits, probe_image
from services.runtime.codecs.webp_header import read_header
from services.runtime.errors import ApiError
from tests.images import astronaut

LIMITS = DecodeLimits(max_pixels=100_000_000)


def kinds() -> dict[str, bytes]:
    rgb = np.asarray(Image.fromarray(astronaut()).resize((301, 177)))
    rgba = np.dstack([rgb, np.full(rgb.shape[:2], 100, np.uint8)])
    out = {}
    for name, im, kw in (("lossy", rgb, {"quality": 80}), ("lossless", rgb, {"lossless": True}),
                         ("lossy alpha", rgba, {"quality": 80}), ("lossless alpha", rgba, {"lossless": True})):
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, "WEBP", **kw)
        out[name] = buf.getvalue()
    buf = io.BytesIO()
    frames = [Image.fromarray(rgb), Image.fromarray(rgb[::-1].copy())]
    frames[0].save(buf, "WEBP", save_all=True, append_images=frames[1:], duration=50)
    out["animated"] = buf.getvalue()
    tags = Image.Exif()
    tags[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "WEBP", exif=tags.tobytes(), xmp=b"<x:xmpmeta/>")
    out["exif and xmp"] = buf.getvalue()
    return out


@pytest.mark.parametrize("kind", list(kinds()))
def test_the_size_animation_and_metadata_are_pillows(kind):
    data = kinds()[kind]
    header = read_header(data)
    with Image.open(io.BytesIO(data)) as im:
        assert (header.width, header.height) == im.size
        assert header.animated == (getattr(im, "n_frames", 1) > 1)
        assert header.exif == im.info.get("exif") and header.xmp == im.info.get("xmp")


def test_probing_never_opens_pillow_s_webp_plugin(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("Pillow's WebP plugin opened the file")
    monkeypatch.setattr(WebPImagePlugin.WebPImageFile, "_open", refuse)
    for kind, data in kinds().items():
        header = probe_image(data, LIMITS)
        assert header.format == "WEBP" and header.pixels == 301 * 177, kind
    assert probe_image(kinds()["exif and xmp"], LIMITS).orientation == 6


def _chunk(tag: bytes, body: bytes) -> bytes:
    return tag + struct.pack("<I", len(body)) + body + b"\x00" * (len(body) % 2)


@pytest.mark.parametrize("body", [_chunk(b"VP8 ", b"\x00" * 3 + b"\x00\x00\x00" + b"\x10\x00\x10\x00"),
                                  _chunk(b"VP8L", b"\x2e" + b"\x00" * 8),
                                  _chunk(b"VP8X", b"\x00" * 10) + _chunk(b"EXIF", b"x" * 8),
                                  _chunk(b"ABCD", b"\x00" * 16),
                                  _chunk(b"VP8 ", b"\x00\x00\x00\x9d\x01\x2a\x00\x00\x10\x00")])
def test_a_broken_header_is_a_400(body):
    data = b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body
    with pytest.raises(ApiError) as err:
        probe_image(data, LIMITS)
    assert (err.value.status, err.value.code) == (400, "corrupt_image")


def test_metadata_counts_only_where_vp8x_says_so():
    """helper-48: an EXIF chunk whose VP8X flag is clear, or one past the RIFF's end, is none to
    libwebp and Pillow; read anyway, it turned the picture (orientation 6)."""
    data = bytearray(kinds()["exif and xmp"])
    assert data[12:16] == b"VP8X" and probe_image(bytes(data), LIMITS).orientation == 6
    data[20] &= ~0x08 & 0xFF
    with Image.open(io.BytesIO(bytes(data))) as im:
        assert im.getexif().get(0x0112) is None
    assert probe_image(bytes(data), LIMITS).orientation == 1
