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
import time

import numpy as np
import pytest
from PIL import Image

from services.runtime.codecs import webp_tables
from services.runtime.codecs.images import DecodeLimits, probe_image
from services.runtime.codecs.vp8l_groups import ParseBudget
from services.runtime.codecs.webp_tables import GROUP_BYTES, lossless_table_bytes, most_groups
from services.runtime.errors import ApiError
from tests.harness import ROOT
from tests.images import astronaut
from tests.webp_bombs import Bits, all_eight_bit_code, one_symbol_code, vp8l_bomb

LIMITS = DecodeLimits(max_pixels=40_000_000)
DECODER_SLACK = 4 * 2**20  # a decoder's own buffers and the allocator's pages: in the service's baseline


def webp(rgb: np.ndarray, **kw) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, "WEBP", **kw)
    return out.getvalue()


def test_a_lossy_picture_is_charged_its_pixels_only():
    data = webp(astronaut(), quality=80)
    assert lossless_table_bytes(data, 512, 512) == 0
    assert probe_image(data, LIMITS).decode_pixels == 2 * 512 * 512  # the picture and Python's copy of it


@pytest.mark.parametrize("form", ["lossless", "lossy with alpha", "animated lossless"])
def test_an_ordinary_lossless_part_is_charged_the_groups_its_entropy_image_names(tmp_path, form, fresh_budget):
    """helper-50: charging every lossless part the most its size allows (65 536 groups, 1.3 GB,
    from a megapixel up) refused every lossless photo of 1 MP or more with 413. Its groups are
    read from its entropy image (tens for a photo), and the charge still covers the decode."""
    side = 1200
    rgb = np.asarray(Image.fromarray(astronaut()).resize((side, side)))
    if form == "lossless":
        data = webp(rgb, lossless=True)
    elif form == "lossy with alpha":
        alpha = np.asarray(Image.fromarray(rgb).convert("L"))
        data = webp(np.dstack([rgb, alpha]), quality=80)
    else:
        out = io.BytesIO()
        frames = [Image.fromarray(rgb), Image.fromarray(rgb[::-1].copy())]
        frames[0].save(out, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
        data = out.getvalue()
    assert _lossless_chunks(data)
    tables = lossless_table_bytes(data, side, side)
    assert 4 * side * side + GROUP_BYTES <= tables <= 4 * side * side + 200 * GROUP_BYTES, tables
    charged = probe_image(data, LIMITS).decode_pixels * 3
    held = _held_by_opencv(tmp_path, data)
    assert held <= charged + DECODER_SLACK, (held, charged)


@pytest.mark.parametrize("lossless", [False, True])
def test_a_webp_with_alpha_is_charged_its_bgra_decode(tmp_path, lossless, fresh_budget):
    """helper-51: OpenCV decodes a WebP with alpha to BGRA, then BGR: a 3000x3000 one held 8.0
    (lossless) and 9.0 (lossy) bytes a pixel where 7.0 were charged."""
    rgb = np.asarray(Image.fromarray(astronaut()).resize((2400, 2400)))
    rgba = np.dstack([rgb, np.asarray(Image.fromarray(rgb).convert("L"))])
    data = webp(rgba, **({"lossless": True} if lossless else {"quality": 80}))
    charged = probe_image(data, LIMITS).decode_pixels * 3
    held = _held_by_opencv(tmp_path, data)
    assert held > 7.5 * 2400 * 2400, held  # more than a picture without alpha holds
    assert held <= charged + DECODER_SLACK, (held, charged)


@pytest.fixture
def fresh_budget(monkeypatch):
    """A reading budget of its own (other tests in this process may have spent the shared one)."""
    budget = ParseBudget()
    monkeypatch.setattr(webp_tables, "PARSE_BUDGET", budget)
    return budget


def test_reading_entropy_images_takes_a_tenth_of_a_core_at_most(monkeypatch):
    """A flood of lossless pictures is read within ParseBudget's share (each read holds the
    GIL: 65 536-group bombs read through kept detect's /healthz p99 at 83 ms); past it a
    picture is charged the most it may name, unread."""
    now = [100.0]
    budget = ParseBudget(share=0.1, burst=0.05, clock=lambda: now[0])
    monkeypatch.setattr(webp_tables, "PARSE_BUDGET", budget)
    photo = webp(np.asarray(Image.fromarray(astronaut()).resize((1200, 1200))), lossless=True)
    read = lossless_table_bytes(photo, 1200, 1200)
    assert read < 4 * 1200 * 1200 + 200 * GROUP_BYTES
    budget.pay(0.06)  # spent past its burst
    assert lossless_table_bytes(photo, 1200, 1200) == most_groups(1200, 1200, len(photo) - 20) * GROUP_BYTES \
        + 4 * 1200 * 1200
    assert budget.skipped == 1
    now[0] += 0.5  # 50 ms of reading back after half a second
    assert lossless_table_bytes(photo, 1200, 1200) == read


def test_a_stream_naming_more_groups_than_an_encoder_is_charged_unread_to_its_end(fresh_budget):
    """The 65 536-group bomb: reading stops at the 2 601st group (no encoder names more), and
    the most it may name is charged."""
    bomb = vp8l_bomb()
    start = time.thread_time()
    assert lossless_table_bytes(bomb, 1024, 1024) >= 65_536 * GROUP_BYTES
    assert time.thread_time() - start < 0.02


def test_a_lossless_stream_that_cannot_be_followed_is_charged_the_most_it_may_name(fresh_budget):
    data = webp(astronaut(), lossless=True)
    at = data.find(b"VP8L") + 8
    cut = data[:at + 12]  # inside its transforms' sub-images
    cut = cut[:4] + struct.pack("<I", len(cut) - 8) + cut[8:12] + b"VP8L" + struct.pack("<I", 12) + cut[at:]
    assert lossless_table_bytes(cut, 512, 512) == most_groups(512, 512, 12) * GROUP_BYTES + 4 * 512 * 512
    assert most_groups(512, 512, 12) == 5  # 96 bits describe 5 groups at most


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
    """Peak RSS growth of a fresh process decoding `data` as a service does (probe_image, then
    decode_probed), in bytes. The decoders are warmed up on small pictures first and the peak
    reset after (VmHWM): their first call's own setup is in a service's baseline."""
    script = ("import sys, numpy as np\n"
              "from services.runtime.codecs.images import DecodeLimits, probe_image, decode_probed, encode_image\n"
              "def kib(name):\n"
              "    return next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith(name))\n"
              "for fmt in ('jpeg', 'png', 'webp'):\n"
              "    small = encode_image(np.zeros((16, 16, 3), np.uint8), fmt)[0]\n"
              "    decode_probed(small, probe_image(small, DecodeLimits(max_pixels=10**6)))\n"
              "data = open(sys.argv[1], 'rb').read()\n"
              "header = probe_image(data, DecodeLimits(max_pixels=40_000_000))\n"
              "open('/proc/self/clear_refs', 'w').write('5')\n"
              "before = kib('VmRSS:')\n"
              "decoded = decode_probed(data, header)\n"
              "print((kib('VmHWM:') - before) * 1024)\n")
    path = tmp_path / "picture"
    path.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.parametrize("fmt, orientation", [("JPEG", 1), ("PNG", 1), ("WEBP", 1), ("JPEG", 6), ("PNG", 3)])
def test_a_plain_picture_is_charged_what_its_decode_holds(tmp_path, fmt, orientation):
    """OpenCV hands its result to Python as a copy, and an EXIF turn copies it again: a
    2400x2400 picture held 6 bytes a pixel where 3 were charged."""
    rgb = np.asarray(Image.fromarray(astronaut()).resize((2400, 1800)))
    im, out = Image.fromarray(rgb), io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    im.save(out, fmt, exif=exif.tobytes(), **({"lossless": False, "quality": 80} if fmt == "WEBP" else {}))
    header = probe_image(out.getvalue(), LIMITS)
    assert header.orientation == orientation
    charged = header.decode_pixels * 3
    held = _held_by_opencv(tmp_path, out.getvalue())
    assert held > 1.5 * 3 * 2400 * 1800, held  # more than the picture alone: the copy is real
    assert held <= charged + DECODER_SLACK, (held, charged)


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
    assert charged == 3 * 2400 * 2400 + max(3 * 2400 * 2400, coefficients)  # freed before Python's copy
    held = _held_by_opencv(tmp_path, data)
    assert held <= charged + DECODER_SLACK, (held, charged)
    if mode == "CMYK":
        assert held > 3 * 2400 * 2400 * 1.5, held  # more than the pixels alone: the charge was short
    plain = io.BytesIO()
    Image.fromarray(rgb).save(plain, "JPEG", quality=90)
    assert probe_image(plain.getvalue(), LIMITS).decode_pixels == 2 * 2400 * 2400  # one scan: none kept


def test_a_chunk_size_that_lies_does_not_shrink_the_charge(tmp_path):
    """helper-47: the bomb in a VP8L chunk that says 78 bytes, the rest of its stream in what the
    walk reads as an unknown chunk: charged 648 KiB, decoded by libwebp (to the buffer's end)
    holding 364 MiB. The stream's bytes are counted to the end of the file."""
    payload = vp8l_bomb()[20:]
    size, covered = next((s, struct.unpack_from("<I", payload, s + 4)[0]) for s in range(6, len(payload) - 8, 2)
                         if payload[s:s + 4] not in (b"VP8L", b"ANMF", b"ALPH")
                         and len(payload) - s - 8 <= struct.unpack_from("<I", payload, s + 4)[0] <= 8_000_000)
    rest = payload[size:] + b"\x00" * (8 + covered + (covered & 1) - len(payload[size:]))
    body = b"VP8L" + struct.pack("<I", size) + payload[:size] + rest
    lying = b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body
    charged = probe_image(lying, LIMITS).decode_pixels * 3
    held = _held_by_opencv(tmp_path, lying)
    assert held > 64 * 2**20 and charged >= held, (held, charged)


def test_a_small_picture_naming_group_999_is_charged_every_group_below_it():
    """helper-47: libwebp builds every group up to the highest named when it is under 1 000: a
    32x32 picture (64 cells) naming group 999 held 7.3 MiB where 64 groups were charged."""
    b = Bits()
    for value, bits in ((0x2F, 8), (31, 14), (31, 14), (0, 1), (0, 3), (0, 1), (0, 1), (1, 1), (0, 3), (0, 1)):
        b.put(value, bits)
    all_eight_bit_code(b, 280)
    all_eight_bit_code(b, 256)
    for _ in range(3):
        one_symbol_code(b)
    for i in range(64):
        b.put_msb_first(999 & 0xFF if i == 0 else 0, 8)
        b.put_msb_first(999 >> 8 if i == 0 else 0, 8)
    for _ in range(1000 * 5):
        one_symbol_code(b)
    payload = b.data()
    chunk = b"VP8L" + struct.pack("<I", len(payload)) + payload + b"\x00" * (len(payload) % 2)
    data = b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk
    assert lossless_table_bytes(data, 32, 32) >= 1000 * GROUP_BYTES


def test_nested_frames_are_walked_without_failing():
    """helper-47: 1 200 ANMF chunks one inside the other made the walk recurse until
    RecursionError (a 500). Frames hold no frames: the walk goes one level down."""
    import cv2
    ok, enc = cv2.imencode(".webp", np.zeros((1, 1, 3), np.uint8), [cv2.IMWRITE_WEBP_QUALITY, 101])
    vp8l = enc.tobytes()[12:]

    def chunk(tag: bytes, body: bytes) -> bytes:
        return tag + struct.pack("<I", len(body)) + body + b"\x00" * (len(body) % 2)
    inner = b""
    for _ in range(1200):
        inner = chunk(b"ANMF", b"\x00" * 16 + vp8l + inner)
    body = b"WEBP" + chunk(b"VP8X", bytes([0x02, 0, 0, 0]) + b"\x00" * 6) + chunk(b"ANIM", b"\x00" * 6) + inner
    data = b"RIFF" + struct.pack("<I", len(body)) + body
    assert lossless_table_bytes(data, 1, 1) > 0
    probe_image(data, LIMITS)  # answered (a header), not an exception


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


def test_a_jpeg_whose_one_scan_carries_one_component_of_three_is_charged_them_all(tmp_path):
    """helper-48: 166 bytes, arithmetic-coded, one scan naming the first of three components:
    libjpeg kept every component's coefficients, charged the pixels alone (a 4-component one
    at 40 MP: 305 MiB held, 114 charged)."""
    side = 2048
    frame = bytes([8]) + struct.pack(">HH", side, side) + bytes([3]) + b"".join(bytes([i, 0x11, 0]) for i in (1, 2, 3))
    data = (b"\xff\xd8" + _segment(0xDB, bytes([0]) + bytes([1] * 64)) + _segment(0xC9, frame)
            + _segment(0xDA, bytes([1, 1, 0, 0, 63, 0])) + b"\x00" * 64 + b"\xff\xd9")
    header = probe_image(data, LIMITS)
    charged = header.decode_pixels * 3
    assert charged == 3 * side * side + 3 * 2 * side * side
    held = _held_by_opencv(tmp_path, data)
    assert 3 * side * side * 2 < held <= charged + DECODER_SLACK, (held, charged)


def test_webp_chunks_past_the_limit_are_refused_and_past_the_riff_are_not_looked_at():
    """helper-48: 2.5 million empty chunks after a 1x1 picture held 78 MiB in libwebp's demuxer
    (413 now); stray bytes after a lossy picture (past its RIFF end) made it a lossless bomb."""
    from services.runtime.codecs.webp_header import MAX_CHUNKS
    lossy = webp(astronaut(), quality=80)
    many = lossy + b"JUNK\x00\x00\x00\x00" * (MAX_CHUNKS + 1)
    many = many[:4] + struct.pack("<I", len(many) - 8) + many[8:]
    with pytest.raises(ApiError) as err:
        probe_image(many, LIMITS)
    assert (err.value.status, err.value.code) == (413, "image_too_complex")
    assert probe_image(lossy + b"\xde\xad" * 8, LIMITS).decode_pixels == 2 * 512 * 512


def test_a_webp_that_opencv_cannot_decode_is_a_400_without_pillow(monkeypatch):
    """A header this reader sizes but OpenCV refuses went to Pillow's plugin, which copied the
    whole file twice holding the GIL; both are libwebp, so the answer is the same 400."""
    from PIL import WebPImagePlugin

    from services.runtime.codecs.images import decode_probed

    opened = []
    real_open = WebPImagePlugin.WebPImageFile._open

    def recorded(self):
        opened.append(1)
        return real_open(self)
    monkeypatch.setattr(WebPImagePlugin.WebPImageFile, "_open", recorded)
    broken = bytearray(webp(astronaut(), lossless=True))
    broken[30:] = bytes(len(broken) - 30)  # the header stands, the stream is zeros
    header = probe_image(bytes(broken), LIMITS)
    with pytest.raises(ApiError) as err:
        decode_probed(bytes(broken), header)
    assert (err.value.status, err.value.code) == (400, "corrupt_image") and not opened
