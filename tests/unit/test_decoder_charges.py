"""What a decoder holds besides the pixels is charged before decoding: a WebP's lossless parts
the Huffman tables libwebp may build for them (a lossy picture nothing more; a lossless one,
a lossy one with lossless alpha, an animation with a lossless frame the most its size and its
bytes allow), a progressive JPEG its coefficients. Each checked against the real decoder."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from services.runtime.codecs.images import DecodeLimits, probe_image
from services.runtime.codecs.webp_tables import GROUP_BYTES, lossless_table_bytes
from tests.harness import ROOT
from tests.images import astronaut
from tests.webp_bombs import vp8l_bomb

LIMITS = DecodeLimits(max_pixels=40_000_000)
DECODER_SLACK = 4 * 2**20  # a decoder's own buffers and the allocator's pages: in the service's baseline


def webp(rgb: np.ndarray, **kw) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, "WEBP", **kw)
    return out.getvalue()


def test_a_lossy_picture_is_charged_its_pixels_only():
    data = webp(astronaut(), quality=80)
    assert lossless_table_bytes(data, 512, 512) == 0
    assert probe_image(data, LIMITS).decode_pixels == 512 * 512


@pytest.mark.parametrize("form", ["lossless", "lossy with alpha", "animated lossless"])
def test_a_lossless_part_is_charged_its_most_tables(form):
    rgb = astronaut()
    if form == "lossless":
        data = webp(rgb, lossless=True)
    elif form == "lossy with alpha":
        data = webp(np.dstack([rgb, np.full(rgb.shape[:2], 128, np.uint8)]), quality=80)
    else:
        out = io.BytesIO()
        frames = [Image.fromarray(rgb), Image.fromarray(rgb[::-1].copy())]
        frames[0].save(out, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
        data = out.getvalue()
    tables = lossless_table_bytes(data, 512, 512)
    chunk = max(len(c) for c in _lossless_chunks(data))
    assert tables == min(128 * 128, chunk * 8 // 20 + 1) * GROUP_BYTES > 0
    assert probe_image(data, LIMITS).decode_pixels >= 512 * 512 + tables // 3


def _lossless_chunks(data: bytes) -> list[bytes]:
    """Every VP8L or ALPH chunk's payload, found by its name (a test's own walk)."""
    out, at = [], 12
    while (found := min((i for i in (data.find(b"VP8L", at), data.find(b"ALPH", at)) if i >= 0), default=-1)) >= 0:
        size = struct.unpack_from("<I", data, found + 4)[0]
        out.append(data[found + 8:found + 8 + size])
        at = found + 8 + size
    return out


def test_a_chunk_walk_that_does_not_add_up_is_charged_as_lossless():
    lossy = webp(astronaut(), quality=80)
    broken = lossy[:16] + struct.pack("<I", 2**31) + lossy[20:]
    assert lossless_table_bytes(broken, 512, 512) > 0


def _held_by_opencv(tmp_path, data: bytes) -> int:
    """Peak RSS growth of a fresh process decoding `data` with cv2.imdecode, in bytes (the peak
    is reset first: importing cv2 peaks higher than a small decode)."""
    script = ("import sys, cv2, numpy as np\n"
              "def kib(name):\n"
              "    return next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith(name))\n"
              "data = np.frombuffer(open(sys.argv[1], 'rb').read(), np.uint8)\n"
              "open('/proc/self/clear_refs', 'w').write('5')\n"
              "before = kib('VmRSS:')\n"
              "assert cv2.imdecode(data, cv2.IMREAD_COLOR) is not None\n"
              "print((kib('VmHWM:') - before) * 1024)\n")
    path = tmp_path / "picture"
    path.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_the_charge_covers_what_libwebp_holds_for_a_picture_of_65_536_groups(tmp_path):
    """helper-45: 300 kB of lossless WebP, 1024x1024, charged 3 MiB, held 360 MiB to decode
    (18 MB of the same kind held 1.25 GB, and sixteen clients took the unit down)."""
    bomb = vp8l_bomb()
    charged = probe_image(bomb, LIMITS).decode_pixels * 3
    held = _held_by_opencv(tmp_path, bomb)  # a valid picture: it decodes
    assert held > 64 * 2**20, json.dumps({"held": held})  # the bomb is real (pixels: 4 MiB)
    assert charged >= held, (charged, held)


@pytest.mark.parametrize("mode, subsampling", [("CMYK", 0), ("RGB", 0), ("RGB", 2)])
def test_a_progressive_jpeg_is_charged_its_coefficients(tmp_path, mode, subsampling):
    """libjpeg keeps a progressive picture's coefficients whole (2 bytes each, every component
    at its own size) besides the pixels: a 40 MP CMYK one held 309 MiB, charged 114 (helper-45)."""
    rgb = np.asarray(Image.fromarray(astronaut()).resize((2400, 2400)))
    out = io.BytesIO()
    Image.fromarray(rgb).convert(mode).save(out, "JPEG", progressive=True, subsampling=subsampling, quality=90)
    data = out.getvalue()
    header = probe_image(data, LIMITS)
    charged = header.decode_pixels * 3
    components = 4 if mode == "CMYK" else 3
    coefficients = 2 * 2400 * 2400 * (components if subsampling == 0 else 1.5)
    assert charged == 3 * 2400 * 2400 + coefficients
    held = _held_by_opencv(tmp_path, data)
    assert held <= charged + DECODER_SLACK, (held, charged)
    if mode == "CMYK":
        assert held > 3 * 2400 * 2400 * 1.5, held  # more than the pixels alone: the charge was short
    plain = io.BytesIO()
    Image.fromarray(rgb).save(plain, "JPEG", quality=90)
    assert probe_image(plain.getvalue(), LIMITS).decode_pixels == 2400 * 2400  # one scan: none kept
