"""The webui's infotext, written and read as the webui does: the linear parser finds exactly
what the webui's regular expression finds (random lines), without its quadratic
backtracking on a long line that a client controls; a request's `infotext` fills only
the fields its body leaves out; JPEG/WebP EXIF carries the text."""

from __future__ import annotations

import io
import random
import re

import pytest
from PIL import Image

from services.img2img import webui_infotext as it
from services.runtime.errors import ApiError

# the webui's own expression (modules/infotext_utils.py)
WEBUI_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def test_the_linear_scan_finds_what_the_webuis_expression_finds():
    rnd = random.Random(7)
    alphabet = 'ab -/:,"\\ \t1_é.'
    for _ in range(50_000):
        line = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 16)))
        assert it._pairs(line) == WEBUI_PARAM.findall(line), repr(line)
    real = 'Steps: 20, Sampler: DPM++ 2M Karras, CFG scale: 7, Seed: 1, Size: 512x768, Lora hashes: "a: 1, b: 2"'
    assert it._pairs(real) == WEBUI_PARAM.findall(real)


@pytest.mark.timeout(60)
def test_a_long_line_without_a_colon_is_parsed_in_linear_time():
    """The webui's expression tries every start position of a run of key characters and
    scans the run to its end from each: ~n^2/2 steps (a 200 KB line: hours). The scan
    skips a run that does not end at a colon whole."""
    line = "a" * 200_000
    assert it._pairs(line) == []
    assert it.parse("a prompt\n" + line)["Prompt"] == "a prompt\n" + line  # the last line is where it looks
    assert it.parse(("word " * 40_000) + "\nSteps: 2, Seed: 3, Size: 8x8")["Steps"] == "2"


def test_parse_as_the_webui_parses():
    text = 'a cat, "quoted"\nmore prompt\nNegative prompt: ugly\nworse\n' \
           'Steps: 20, Sampler: Euler a, CFG scale: 7.5, Seed: 42, Size: 512x768, Lora: "x: 1, y"'
    p = it.parse(text)
    assert p["Prompt"] == 'a cat, "quoted"\nmore prompt' and p["Negative prompt"] == "ugly\nworse"
    assert (p["Steps"], p["Sampler"], p["CFG scale"], p["Seed"]) == ("20", "Euler a", "7.5", "42")
    assert (p["Size-1"], p["Size-2"], p["Lora"]) == ("512", "768", "x: 1, y")
    assert (p["Clip skip"], p["Schedule type"], p["RNG"]) == ("1", "Automatic", "GPU")  # the webui's defaults
    # fewer than three pairs on the last line: it is prompt
    assert it.parse("just: a prompt")["Prompt"] == "just: a prompt"


def test_infotext_fills_only_what_the_body_leaves_out():
    text = "a fox\nNegative prompt: blur\nSteps: 12, Sampler: DDIM, Schedule type: Karras, CFG scale: 4.5, " \
           "Seed: 99, Size: 320x240, Denoising strength: 0.4, Mask blur: 2"
    out = it.apply({"infotext": text, "steps": 30, "prompt": "mine"}, img2img=True)
    assert out["steps"] == 30 and out["prompt"] == "mine"  # the body wins
    assert (out["negative_prompt"], out["sampler_name"], out["scheduler"], out["cfg_scale"], out["seed"]) == \
        ("blur", "DDIM", "Karras", 4.5, 99)
    assert (out["width"], out["height"], out["denoising_strength"], out["mask_blur"]) == (320, 240, 0.4, 2)
    assert "mask_blur" not in it.apply({"infotext": text}, img2img=False)
    assert it.apply({"infotext": ""}, img2img=True) == {"infotext": ""}
    with pytest.raises(ApiError) as err:
        it.apply({"infotext": "p\nSteps: many, Seed: 1, Size: 8x8"}, img2img=True)
    assert (err.value.status, err.value.code) == (422, "invalid_parameter") and "Steps" in err.value.message


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
def test_exif_carries_the_infotext(fmt):
    text = "ünïcode prompt\nSteps: 2, Seed: 5, Size: 8x8"
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, fmt, exif=it.exif_with_infotext(text))
    info, items = it.read_info(Image.open(io.BytesIO(buf.getvalue())), 10_000)
    assert info == text and "exif" not in items
    # a JPEG segment holds 64 KiB: a longer text is cut, never an encoder failure
    long = "x" * 100_000
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "JPEG", exif=it.exif_with_infotext(long))
    info, _ = it.read_info(Image.open(io.BytesIO(buf.getvalue())), 200_000)
    assert 25_000 < len(info) < len(long) and set(info) == {"x"}


@pytest.mark.parametrize("fmt", ["webp", "jpg"])
@pytest.mark.parametrize("size", [(64, 48), (801, 600)])  # Pillow's WebP encoder below 0.26 MP, OpenCV's above
def test_a_webp_or_jpeg_answer_carries_the_infotext_from_either_encoder(size, fmt):
    import base64

    import numpy as np
    text = "ünïcode prompt\nSteps: 2, Seed: 5, Size: 8x8"
    rgb = np.random.default_rng(1).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    sent = base64.b64decode(it.encode_picture(Image.fromarray(rgb), fmt, 80, text))
    with Image.open(io.BytesIO(sent)) as im:
        im.load()
        assert (im.format, im.size) == ({"webp": "WEBP", "jpg": "JPEG"}[fmt], size)
        info, items = it.read_info(im, 10_000)
        assert info == text and "exif" not in items
        assert np.abs(np.asarray(im.convert("RGB")).astype(int) - rgb).mean() < 60  # the pixels, lossy


@pytest.mark.parametrize("text", ["plain prompt\nSteps: 2, Seed: 5, Size: 8x8", "ünïcode 猫 prompt\nSteps: 2"])
def test_a_png_answer_carries_its_texts_as_pillow_writes_them(text):
    import base64
    import zlib

    import numpy as np
    rgb = np.random.default_rng(2).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    sent = base64.b64decode(it.encode_picture(Image.fromarray(rgb), "png", 80, text))
    with Image.open(io.BytesIO(sent)) as im:
        im.load()  # every chunk's CRC checked on the way
        assert im.format == "PNG" and im.info["parameters"] == text and np.array_equal(np.asarray(im), rgb)
    kind = b"tEXt" if text.isascii() else b"iTXt"  # Latin-1 as tEXt, the rest as iTXt, as PngInfo.add_text
    at = sent.index(kind)
    assert sent[at - 4 - 25:at - 4][4:8] == b"IHDR"  # right after the header
    data = sent[at + 4:at + 4 + int.from_bytes(sent[at - 4:at], "big")]
    assert zlib.crc32(kind + data).to_bytes(4, "big") == sent[at + 4 + len(data):at + 8 + len(data)]
    two = base64.b64decode(it.encode_png(Image.fromarray(rgb), {"a": "1", "b": "ß", "parameters": text}))
    with Image.open(io.BytesIO(two)) as im:
        im.load()
        assert (im.info["a"], im.info["b"], im.info["parameters"]) == ("1", "ß", text)
        assert np.array_equal(np.asarray(im), rgb)
