"""A submit's image checks read the image's header only: the base64 text is checked whole
without being decoded, and only its first bytes are decoded (more only when a JPEG's header
lies past big segments). The service decodes the image once, when the job runs."""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest
from PIL import Image

from services.jobs import payload
from services.jobs.payload import Limits, check_image_b64
from services.runtime.errors import ApiError
from tests.images import encode

LIMITS = Limits(max_image_bytes=20 * 2**20, max_pixels=4_000_000)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def decoded(monkeypatch) -> list[int]:
    """The length of every base64 text the check decodes."""
    seen: list[int] = []
    real = base64.b64decode

    def spy(text, *args, **kwargs):
        seen.append(len(text))
        return real(text, *args, **kwargs)
    monkeypatch.setattr(payload.base64, "b64decode", spy)
    return seen


def test_a_big_image_is_checked_from_its_first_bytes_only(decoded):
    png = encode(np.zeros((64, 64, 3), np.uint8)) + b"\0" * (8 * 2**20)  # a valid header, then 8 MB
    check_image_b64(b64(png), "image", LIMITS)
    assert decoded and max(decoded) <= 4 * (64 * 1024) // 3 + 4


def test_a_jpeg_whose_header_lies_past_a_big_segment_is_read_with_more_bytes(decoded):
    jpeg = encode(np.zeros((40, 30, 3), np.uint8), "JPEG")
    app = b"\xff\xe2" + struct.pack(">H", 65535) + b"\0" * 65533  # ICC-sized segments before the frame header
    big = jpeg[:2] + app * 5 + jpeg[2:]
    check_image_b64(b64(big), "image", LIMITS)
    assert len(decoded) == 2 and decoded[-1] < len(b64(big)) + 1  # the second step: 1 MiB, not the whole


def test_pixels_over_the_limit_are_found_from_the_header():
    with pytest.raises(ApiError) as err:
        check_image_b64(b64(encode(np.zeros((2100, 2000, 3), np.uint8))), "image", LIMITS)
    assert (err.value.status, err.value.code) == (413, "too_many_pixels")


@pytest.mark.parametrize("text,status,code", [
    ("AAAA#", 400, "bad_base64"), ("AAA", 400, "bad_base64"), ("A" * 5, 400, "bad_base64"),
    ("", 400, "empty_image"), ("====", 400, "bad_base64"), ("\u00e9AAA", 400, "bad_base64"),
])
def test_base64_that_is_not_is_refused_without_decoding_it(text, status, code):
    with pytest.raises(ApiError) as err:
        check_image_b64(text, "image", LIMITS)
    assert (err.value.status, err.value.code) == (status, code)


def test_the_size_comes_from_the_base64_length():
    small = Limits(max_image_bytes=1000, max_pixels=10**6)
    png = encode(np.zeros((8, 8, 3), np.uint8))
    check_image_b64(b64(png + b"\0" * (1000 - len(png))), "image", small)
    with pytest.raises(ApiError) as err:
        check_image_b64(b64(png + b"\0" * (1001 - len(png))), "image", small)
    assert err.value.code == "image_too_large" and "1001 bytes" in err.value.message


def test_mime_wrapped_base64_and_data_urls_are_taken():
    png = encode(np.zeros((10, 12, 3), np.uint8))
    text = b64(png)
    wrapped = "\r\n".join(text[i:i + 76] for i in range(0, len(text), 76)) + "\r\n"
    check_image_b64(wrapped, "image", LIMITS)
    check_image_b64("data:image/png;base64," + text, "image", LIMITS)
    with Image.open(io.BytesIO(png)) as im:
        assert im.size == (12, 10)


class _ScanSpy:
    """Stands in for the whole-text alphabet check: records the length of every text scanned."""

    def __init__(self, real):
        self.real, self.scanned = real, []

    def fullmatch(self, text):
        self.scanned.append(len(text))
        return self.real.fullmatch(text)


@pytest.fixture
def scans(monkeypatch) -> list[int]:
    spy = _ScanSpy(payload.B64_RE)
    monkeypatch.setattr(payload, "B64_RE", spy)
    return spy.scanned


@pytest.mark.parametrize("data,limits,status,code", [
    (b"\0" * 3_000_000, LIMITS, 415, "unsupported_image"),   # junk: its first bytes are no picture
    (b"GIF89a" + b"\0" * 3_000_000, LIMITS, 415, "unsupported_image"),
    (encode(np.zeros((8, 8, 3), np.uint8)) + b"\0" * 3_000_000, Limits(2_000_000, 10**6), 413, "image_too_large"),
])
def test_a_field_of_junk_or_of_too_many_bytes_is_refused_before_its_whole_text_is_scanned(scans, data, limits,
                                                                                         status, code):
    text = b64(data)
    for field in (text, text[:-8] + "*" + text[-7:]):  # a bad character near its end is never reached
        with pytest.raises(ApiError) as err:
            check_image_b64(field, "image", limits)
        assert (err.value.status, err.value.code) == (status, code)
    assert scans == []


def test_a_picture_within_the_limits_has_its_whole_text_checked(scans):
    png = encode(np.zeros((8, 8, 3), np.uint8)) + b"\0" * 300_000
    text = b64(png)
    check_image_b64(text, "image", LIMITS)
    assert scans == [len(text)]
    bad = text[:200_000] + "*" + text[200_001:]  # past the first bytes decoded: found by the whole-text check
    with pytest.raises(ApiError) as err:
        check_image_b64(bad, "image", LIMITS)
    assert (err.value.status, err.value.code) == (400, "bad_base64")
    spaced = text[:200_000] + " " + text[200_001:]
    with pytest.raises(ApiError) as err:
        check_image_b64(spaced, "image", LIMITS)
    assert err.value.code == "bad_base64"


@pytest.mark.parametrize("junk", [b"\xff", b"\x00"])
def test_a_jpeg_field_of_fill_or_junk_bytes_shows_pillow_a_short_header(pillow_reads, junk):
    """Pillow steps through fill and extraneous bytes a byte at a time in Python: a 20 MiB
    field of them held a helper for 5.5 s. It is shown the header without them."""
    with pytest.raises(ApiError) as err:
        check_image_b64(b64(b"\xff\xd8\xff" + junk * (2 << 20)), "image", LIMITS)
    assert (err.value.status, err.value.code) == (400, "corrupt_image")
    assert pillow_reads and max(pillow_reads) < 64 * 1024
    jpeg = encode(np.zeros((40, 30, 3), np.uint8), "JPEG")
    pillow_reads.clear()
    assert check_image_b64(b64(jpeg[:2] + b"\xff" * (2 << 20) + jpeg[2:]), "image", LIMITS)[1:] == (30, 40)
    assert pillow_reads and max(pillow_reads) < 64 * 1024
