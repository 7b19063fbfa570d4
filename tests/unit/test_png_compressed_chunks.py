"""What Pillow inflates in a PNG (zTXt and iTXt text, iCCP profiles) is kept from it wherever
a header or a mask is read, on real crafted files: the service's probe, the jobs API's check of
a submit (whatever follows the pixels), an img2img mask's alpha and png-info's metadata."""

from __future__ import annotations

import io
import zlib

import numpy as np
import PIL.PngImagePlugin
import pytest
from PIL import Image

from services.img2img.webui_images import mask_channel
from services.img2img.webui_infotext import open_metadata, read_info
from services.jobs.payload import PNG_WALK_CHUNKS, Limits, check_image
from services.runtime.codecs.images import DecodeLimits, decode_image, probe_image
from services.runtime.errors import ApiError
from tests.images import _chunk, icc_bomb_png, small_png, text_bomb_png

LIMITS = DecodeLimits(max_pixels=40_000_000)
JOBS = Limits(20 << 20, 40_000_000)


@pytest.fixture
def inflated(monkeypatch) -> list[str]:
    """The compressed chunks Pillow inflates, by kind, as it meets them."""
    seen: list[str] = []
    for name in ("chunk_zTXt", "chunk_iTXt", "chunk_iCCP"):
        real = getattr(PIL.PngImagePlugin.PngStream, name)

        def spy(self, pos, length, real=real, name=name):
            seen.append(name)
            return real(self, pos, length)
        monkeypatch.setattr(PIL.PngImagePlugin.PngStream, name, spy)
    return seen


def _after_pixels(png: bytes, extra: bytes) -> bytes:
    at = png.rfind(b"IEND") - 4
    return png[:at] + extra + png[at:]


def test_the_jobs_check_reads_the_header_without_text_whatever_follows_the_pixels(inflated):
    """Chunks after the pixels are no cost of reading the header: 4097 of them made the walk
    give up and hand Pillow the whole file, which inflated the 64 MB of text before the pixels."""
    bomb = _after_pixels(text_bomb_png(64, 1_000_000, after_pixels=False), _chunk(b"tEXt", b"k\0v") * 4097)
    assert check_image(bomb, "image", JOBS) == (48, 32)
    assert inflated == []


def test_the_jobs_check_refuses_more_chunks_before_the_pixels_than_any_service_takes():
    base = small_png()
    bomb = base[:33] + _chunk(b"tEXt", b"") * (PNG_WALK_CHUNKS + 1) + base[33:]
    with pytest.raises(ApiError) as err:
        check_image(bomb, "init_images.0", JOBS)
    assert (err.value.status, err.value.code) == (413, "image_too_complex")
    assert err.value.message.startswith("init_images.0: ")


def test_icc_profiles_are_not_inflated_to_read_a_header(inflated):
    """40 profiles of 1 MB in a 40 kB file: Pillow inflated each to open it (500 of them:
    1 s of CPU a probe; 4000 in 4 MB: 7.8 s in the jobs check), with no total to stop it."""
    bomb = icc_bomb_png(40)
    header = probe_image(bomb, LIMITS)
    assert (header.format, header.width, header.height) == ("PNG", 48, 32)
    assert check_image(bomb, "image", JOBS) == (48, 32)
    assert inflated == []
    assert (decode_image(bomb, LIMITS).rgb == decode_image(small_png(), LIMITS).rgb).all()


def _rgba_mask() -> tuple[bytes, np.ndarray]:
    rgba = np.zeros((32, 48, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[:16, :, 3] = 0
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    return buf.getvalue(), rgba


def test_a_masks_alpha_is_read_without_its_compressed_chunks(inflated):
    """An img2img mask is opened a second time for its alpha: Pillow inflated its text there
    (before and after the pixels), and over 64 MB of it raised a ValueError: a 500."""
    clean, rgba = _rgba_mask()
    text = _chunk(b"zTXt", b"parameters\0\0" + zlib.compress(b"a" * 1_000_000, 9))
    at = clean.find(b"IDAT") - 4
    bomb = _after_pixels(clean[:at] + text * 40 + clean[at:], text * 40)
    rgb = decode_image(bomb, LIMITS).rgb
    alpha = np.asarray(mask_channel(bomb, rgb))
    assert (alpha == np.where(rgba[..., 3] > 128, 255, 0)).all()
    assert inflated == []


def test_png_info_reads_the_text_and_not_the_profiles(inflated):
    bomb = icc_bomb_png(40)
    with_text = bomb[:33] + _chunk(b"tEXt", b"parameters\0a cat\nSteps: 3") + bomb[33:]
    text, _items = read_info(open_metadata(with_text, ("PNG",)), 10_000)
    assert text == "a cat\nSteps: 3"
    assert inflated == []
