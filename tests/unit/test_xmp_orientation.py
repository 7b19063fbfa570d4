"""A picture whose orientation is only in its XMP packet (tiff:Orientation), as some editors
write it: Pillow's getexif() falls back to it when the EXIF block has no orientation tag, and
so did probe_image before it read the EXIF block itself. The same picture must still be
turned the same way."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from services.runtime.codecs.images import DecodeLimits, probe_image

LIMITS = DecodeLimits(max_pixels=100_000_000)


def xmp(orientation: int, attribute: bool = True) -> bytes:
    value = f'tiff:Orientation="{orientation}"' if attribute else f"><tiff:Orientation>{orientation}</tiff:Orientation"
    return (f'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
            f'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" {value}/></rdf:RDF></x:xmpmeta>').encode()


def picture(fmt: str, exif_orientation: int | None, xmp_packet: bytes | None, with_exif: bool = True) -> bytes:
    im = Image.fromarray(np.zeros((20, 30, 3), np.uint8))
    kw = {}
    if with_exif:
        tags = Image.Exif()
        tags[0x010F] = "camera"
        if exif_orientation is not None:
            tags[0x0112] = exif_orientation
        kw["exif"] = tags.tobytes()
    if xmp_packet is not None:
        kw["xmp"] = xmp_packet
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
@pytest.mark.parametrize("exif_orientation,xmp_packet,with_exif,expected", [
    (None, xmp(6), False, 6),          # no EXIF block at all
    (None, xmp(8), True, 8),           # an EXIF block without the tag
    (None, xmp(5, attribute=False), True, 5),
    (3, xmp(6), True, 3),              # the EXIF tag wins
    (None, xmp(9), True, 1),           # out of range
    (None, None, True, 1),
])
def test_the_xmp_orientation_is_pillows(fmt, exif_orientation, xmp_packet, with_exif, expected):
    data = picture(fmt, exif_orientation, xmp_packet, with_exif)
    pillow = Image.open(io.BytesIO(data)).getexif().get(0x0112) or 1
    assert (pillow if pillow in range(1, 9) else 1) == expected
    header = probe_image(data, LIMITS)
    assert header.orientation == expected
    assert (header.width, header.height) == ((20, 30) if expected in (5, 6, 7, 8) else (30, 20))
