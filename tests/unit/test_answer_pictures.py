"""Answers made from Pillow pictures: the pixels read a slice of rows at a time (np.asarray
held the GIL for the whole copy), PNG text chunks and JPEG/WebP EXIF blocks put in as
Pillow writes them, without a copy of the whole answer in one go."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from PIL import Image

import onecard
from services.runtime.codecs.exif_segments import jpeg_pieces, webp_pieces
from services.runtime.codecs.images import encode_image
from services.runtime.codecs.pil_arrays import array_of
from tests.gil_holds import longest_gil_hold_s

RNG = np.random.default_rng(11)
USER_COMMENT = 0x9286


def exif_with(text: str) -> bytes:
    exif = Image.Exif()
    exif.get_ifd(0x8769)[USER_COMMENT] = b"UNICODE\x00" + text.encode("utf-16-be")
    return exif.tobytes()


def comment_of(im: Image.Image) -> str:
    raw = im.getexif().get_ifd(0x8769)[USER_COMMENT]
    return raw[8:].decode("utf-16-be")


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P", "1"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 5000), (5000, 1), (700, 900), (1201, 333)])
def test_the_pixels_of_a_picture_are_what_numpy_reads_of_it(mode, shape):
    img = Image.fromarray(RNG.integers(0, 256, (*shape, 3), dtype=np.uint8)).convert(mode)
    got = array_of(img)
    want = np.asarray(img)
    assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)


def test_reading_a_big_picture_holds_the_gil_a_slice_at_a_time():
    img = Image.fromarray(RNG.integers(0, 256, (3000, 4000, 3), dtype=np.uint8))
    kept = []
    whole = longest_gil_hold_s(lambda: kept.append(np.asarray(img)))
    ours = longest_gil_hold_s(lambda: kept.append(array_of(img)), tries=5)
    assert ours < whole / 4, (ours, whole)


def test_a_pillow_picture_is_encoded_as_its_rgb_array_is():
    rgb = RNG.integers(0, 256, (300, 500, 3), dtype=np.uint8)
    for fmt in ("png", "jpeg", "webp"):
        assert encode_image(Image.fromarray(rgb), fmt, 80) == encode_image(rgb, fmt, 80)
    rgba = Image.fromarray(RNG.integers(0, 256, (30, 50, 4), dtype=np.uint8), "RGBA")
    assert encode_image(rgba, "png") == encode_image(np.asarray(rgba.convert("RGB")), "png")


def test_png_text_chunks_are_written_as_pillow_writes_them_and_read_back():
    rgb = RNG.integers(0, 256, (40, 60, 3), dtype=np.uint8)
    texts = {"parameters": "plain\nSteps: 2", "postprocessing": "ünïcode 猫", "x": ""}
    data, mime = encode_image(rgb, "png", texts=texts)
    with Image.open(io.BytesIO(data)) as im:
        im.load()  # every chunk's CRC checked
        assert mime == "image/png" and {k: im.info[k] for k in texts} == texts
        assert np.array_equal(np.asarray(im), rgb)
    assert data.index(b"tEXtparameters") < data.index(b"iTXtpostprocessing") < data.index(b"IDAT")
    for key in ("", "k" * 80, "caf\u00e9\u0101", "a\nb"):
        with pytest.raises(ValueError, match="keyword"):
            encode_image(rgb, "png", texts={key: "v"})
    with pytest.raises(ValueError, match="PNG"):
        encode_image(rgb, "jpeg", texts={"a": "b"})


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_an_exif_block_goes_into_jpeg_and_webp_answers(fmt):
    rgb = RNG.integers(0, 256, (200, 300, 3), dtype=np.uint8)
    text = "ünïcode prompt\nSteps: 2"
    plain, _ = encode_image(rgb, fmt, 90)
    data, mime = encode_image(rgb, fmt, 90, exif=exif_with(text))
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        assert mime == f"image/{fmt}" and im.size == (300, 200) and comment_of(im) == text
        with Image.open(io.BytesIO(plain)) as without:
            assert np.array_equal(np.asarray(im), np.asarray(without))  # the same picture, the EXIF added
    if fmt == "jpeg":  # after the JFIF header, as Pillow writes it
        assert data[2:4] == b"\xff\xe0" and data[4 + int.from_bytes(data[4:6], "big"):][:2] == b"\xff\xe1"
    with pytest.raises(ValueError, match="EXIF"):
        encode_image(rgb, "png", exif=exif_with(text))


def test_exif_that_a_jpeg_segment_cannot_hold_is_refused():
    jpeg, _ = encode_image(RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8), "jpeg")
    with pytest.raises(ValueError, match="64 KiB"):
        jpeg_pieces(jpeg, exif_with("x" * 40_000))
    with pytest.raises(ValueError, match="JPEG"):
        jpeg_pieces(b"GIF89a", exif_with("x"))


def test_a_lossless_webp_takes_exif_the_same_way_and_an_extended_one_is_left_as_it_is():
    rgb = RNG.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    lossless = io.BytesIO()
    Image.fromarray(rgb).save(lossless, "WEBP", lossless=True)
    data = b"".join(webp_pieces(lossless.getvalue(), exif_with("text")))
    with Image.open(io.BytesIO(data)) as im:
        assert comment_of(im) == "text" and np.array_equal(np.asarray(im.convert("RGB")), rgb)
    assert webp_pieces(data, exif_with("other")) == [data]


@pytest.mark.parametrize(("picture", "fmt", "quality", "says"), [
    (np.zeros((8, 8, 3), np.uint8), "gif", None, "cannot encode as 'gif'"),
    (np.zeros((8, 8, 3), np.uint8), "jpeg", "high", "quality is a number"),
    (np.zeros((8, 8, 3), np.uint8), "webp", float("nan"), "quality is a number"),
    (np.zeros((8, 8, 3), np.uint8), "jpeg", float("inf"), "quality is a number"),
    (np.zeros((8, 0, 3), np.uint8), "png", None, "empty picture (0x8)"),
    (np.zeros((0, 8, 3), np.uint8), "jpeg", None, "empty picture (8x0)"),
    (np.zeros(12, np.uint8), "png", None, "not ndarray(12,)"),
    ([[1, 2], [3, 4]], "png", None, "not list"),
])
def test_a_misused_encode_is_told_what_is_wrong(picture, fmt, quality, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        onecard.encode_image(picture, fmt, quality)


@pytest.mark.parametrize(("fmt", "given", "taken"), [
    ("jpeg", np.int64(50), 50), ("jpeg", 0, None), ("jpeg", 2.6, 3), ("jpeg", 250, 100), ("jpeg", -4, 1),
    ("webp", 0, None), ("webp", 101, 100), ("webp", 90.0, 90), ("png", "ignored", None), ("png", 500, None),
    ("jpeg", 0.4, 1), ("jpeg", 10**400, 100), ("webp", -(10**400), 1),
])
def test_a_quality_is_taken_as_it_always_was(fmt, given, taken):
    """API 1.x: rounded, 0 for the default, clamped to 1..100, none for PNG."""
    picture = np.random.default_rng(5).integers(0, 256, (32, 32, 3), np.uint8)
    assert onecard.encode_image(picture, fmt, given) == onecard.encode_image(picture, fmt, taken)
