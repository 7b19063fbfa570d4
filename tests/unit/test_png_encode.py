"""PNG answers (services.runtime.codecs.png_encode): standard files that every decoder reads
back to the same pixels, and a big answer keeps the GIL for far shorter stretches than
OpenCV's imencode did (it hands its output to Python and frees its own with the GIL held)."""

from __future__ import annotations

import io
import zlib

import cv2
import numpy as np
import pytest
from PIL import Image

from services.runtime.codecs.images import encode_image, resize_image
from services.runtime.codecs.png_encode import encode_png
from tests.gil_holds import longest_gil_hold_s

RNG = np.random.default_rng(7)


@pytest.mark.parametrize("shape", [(1, 1), (1, 700), (700, 1), (3, 5), (257, 1031), (1500, 2000)])
def test_every_decoder_reads_back_the_same_pixels(shape):
    rgb = RNG.integers(0, 256, (*shape, 3), dtype=np.uint8)
    data = encode_png(rgb)
    with Image.open(io.BytesIO(data)) as im:
        im.verify()  # chunk CRCs and structure
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG" and im.mode == "RGB" and im.size == (shape[1], shape[0])
        assert np.array_equal(np.asarray(im), rgb)
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    assert np.array_equal(bgr[..., ::-1], rgb)


def test_the_file_is_one_header_the_rows_and_an_end():
    data = encode_png(np.zeros((300, 4000, 3), np.uint8) + 200)
    at, kinds = 8, []
    while at < len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + size]
        assert int.from_bytes(data[at + 8 + size:at + 12 + size], "big") == zlib.crc32(kind + body)
        kinds.append(kind)
        at += 12 + size
    assert at == len(data) and kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    assert set(kinds[1:-1]) == {b"IDAT"}
    assert len(data) < 300 * 4000 * 3 // 50  # a flat picture compresses (run-length matching)


def test_what_is_not_rgb_bytes_is_refused():
    for bad in (np.zeros((4, 4), np.uint8), np.zeros((4, 4, 4), np.uint8), np.zeros((4, 4, 3), np.float32),
                np.zeros((0, 4, 3), np.uint8)):
        with pytest.raises(ValueError):
            encode_png(bad)


def test_encode_image_makes_png_answers_here_and_others_with_opencv():
    rgb = RNG.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    data, mime = encode_image(rgb, "png")
    assert mime == "image/png" and data == encode_png(rgb)
    for fmt, mime in (("jpeg", "image/jpeg"), ("webp", "image/webp")):
        data, got = encode_image(rgb, fmt)
        assert got == mime and cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR).shape == (64, 96, 3)


@pytest.mark.parametrize("kind", ["rgba", "16-bit", "float", "gray"])
def test_png_answers_of_other_pixels_are_made_as_before(kind):
    """encode_image (onecard.image's answers) took whatever OpenCV's PNG path took: RGBA (alpha
    dropped), 16-bit (kept), float (saturated to 8 bits), gray. Those still answer a PNG, the
    same pixels as before, not a 500 from the encoder made for RGB bytes."""
    from services.runtime.codecs.images import PNG_PARAMS
    rgb = RNG.integers(0, 256, (40, 50, 3), dtype=np.uint8)
    pixels = {"rgba": np.dstack([rgb, np.full((40, 50), 7, np.uint8)]), "16-bit": rgb.astype(np.uint16) * 257,
              "float": rgb.astype(np.float32) * 1.5, "gray": rgb[..., 0]}[kind]
    data, mime = encode_image(pixels, "png")
    ok, before = cv2.imencode(".png", cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR), PNG_PARAMS)
    assert mime == "image/png" and ok
    got = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    want = cv2.imdecode(before, cv2.IMREAD_UNCHANGED)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_big_answer_keeps_the_gil_for_far_less_than_one_copy_of_the_picture():
    """OpenCV compressed with the GIL released, then held it to hand its output over and free
    its own buffer: 6 ms for a 12 MP picture, 30-90 ms when the kernel compacted memory for
    huge pages. Here every GIL-held step is a slice, whatever the picture's size: each keeps
    the GIL for far less than one copy of the picture made holding it (ndarray.tobytes, 26 ms
    here for these 24 MP). (Not OpenCV itself as the measure: how long it holds the GIL
    depends on whether its buffer got huge pages, 0.5 to 160 ms from one call to the next,
    and the shortest of a few tries was sometimes shorter than ours.)"""
    rgb = RNG.integers(0, 256, (4000, 6000, 3), dtype=np.uint8)
    kept = []  # the answers outlive the measure, as a service's do (it frees them apart: gil_lane)
    one_copy = longest_gil_hold_s(lambda: kept.append(rgb.tobytes()))
    ours = longest_gil_hold_s(lambda: kept.append(encode_image(rgb, "png")), tries=5)
    assert ours < one_copy / 4, (ours, one_copy)


def test_resize_image_grows_with_lanczos_shrinks_by_area_and_keeps_a_picture_of_its_size():
    rgb = RNG.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    assert resize_image(rgb, (40, 30)) is rgb
    big = resize_image(rgb, (400, 300))
    assert big.shape == (300, 400, 3) and big.dtype == np.uint8
    assert np.array_equal(big, cv2.resize(rgb, (400, 300), interpolation=cv2.INTER_LANCZOS4))
    flat = np.full((300, 400, 3), 90, np.uint8)
    flat[::2, ::2] = 10   # area averaging of 10x10 blocks: the mean, not one sample
    small = resize_image(flat, (40, 30))
    assert small.shape == (30, 40, 3) and np.all(np.abs(small.astype(int) - 70) <= 1)
    with pytest.raises(ValueError):
        resize_image(rgb, (0, 10))


def test_img2img_brings_its_answer_to_the_picture_size_without_pillow_holding_the_gil():
    """The model's 1024 px answer back to a 12 MP picture's size: Pillow resized it with the
    GIL released, but handing the result to numpy copied 36 MB with it held."""
    from types import SimpleNamespace

    from services.img2img.app import Img2ImgRoutes
    routes = Img2ImgRoutes(None, SimpleNamespace(postprocess=lambda item, out: out), None)
    item = SimpleNamespace(out_size=(4000, 3000))
    out = RNG.integers(0, 256, (768, 1024, 3), dtype=np.uint8)
    kept = []
    assert routes.finish(item, out).shape == (3000, 4000, 3)
    pillow = longest_gil_hold_s(lambda: kept.append(np.asarray(Image.fromarray(out).resize((4000, 3000),
                                                                                          Image.LANCZOS))))
    ours = longest_gil_hold_s(lambda: kept.append(routes.finish(item, out)), tries=5)
    assert ours < pillow / 2, (ours, pillow)
