"""What a decode may cost, bounded before the decoder runs, on real crafted files: PNG chunk
bombs, RLE-compressed BMPs (which Pillow decodes in pure Python), header-only probes, EXIF
orientation through OpenCV, MIME-wrapped base64, encoder limits and JSON answers."""

from __future__ import annotations

import base64
import io
import json
import struct

import numpy as np
import pytest
from PIL import Image, ImageOps

from services.runtime.codecs import png_bmp as formats
from services.runtime.codecs.base64_text import decode_base64, encode_base64
from services.runtime.codecs.images import DecodeLimits, decode_image, encode_image, probe_image
from services.runtime.codecs.json_answer import json_bytes, json_parts
from services.runtime.errors import ApiError
from tests.images import _chunk, astronaut, encode, pixel_bomb_png

LIMITS = DecodeLimits(max_pixels=40_000_000, max_jpeg_scans=32, max_image_markers=512)


def chunk_bomb_png(chunks: int, kind: bytes = b"tEXt") -> bytes:
    """A 64x64 PNG with `chunks` empty ancillary chunks before its data."""
    good = encode(np.zeros((64, 64, 3), np.uint8))
    head, rest = good[:33], good[33:]                     # signature + IHDR, then the rest
    return head + _chunk(kind, b"") * chunks + rest


def rle8_bmp(width: int, height: int, filler_bytes: int) -> bytes:
    """An RLE8 BMP whose pixel data is `filler_bytes` of absolute runs that never end the picture."""
    palette = b"".join(struct.pack("<BBBB", i, i, i, 0) for i in range(256))
    data = (b"\x00\x03abc\x00" * (filler_bytes // 6)) + b"\x00\x01"
    offset = 14 + 40 + len(palette)
    header = struct.pack("<2sIHHI", b"BM", offset + len(data), 0, 0, offset)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(data), 2835, 2835, 256, 0)
    return header + info + palette + data


def test_a_png_with_a_million_empty_chunks_is_refused_by_the_walk_fast():
    bomb = chunk_bomb_png(200_000)
    with pytest.raises(ApiError) as err:
        probe_image(bomb, LIMITS)
    assert (err.value.status, err.value.code) == (413, "image_too_complex")
    assert "PNG chunks: 513" in err.value.message  # the walk stopped at the first one over
    assert probe_image(chunk_bomb_png(500), LIMITS).pixels == 64 * 64  # within the limit: fine


def test_the_walk_stops_where_both_decoders_call_a_chunk_type_broken():
    """A PNG header and then zeros (base64 'AAAA...' in a jobs submit) reads as empty chunks of
    type 0: walked one by one, 100 000 of them held a jobs helper 0.2 s before the chunk limit.
    Both decoders call such a chunk broken, so the walk ends there and the answer is a 400."""
    head = encode(np.zeros((64, 64, 3), np.uint8))[:33]        # signature + IHDR
    zeros = head + b"\0" * 1_200_000
    assert formats.walk_png(zeros, 512).chunks == 1
    assert formats.walk_png(head + b"\0\0\0\0tE\0t" + b"\0" * 64, 512).chunks == 1
    with pytest.raises(ApiError) as err:
        probe_image(zeros, LIMITS)
    assert (err.value.status, err.value.code) == (400, "corrupt_image")
    # a type Pillow takes (digits, an underscore) and skips is walked past, not stopped at: what
    # follows is still counted (found by helper-34: 'ab1c' then 100 000 chunks took 0.41 s)
    hidden = head + _chunk(b"ab1c", b"") + _chunk(b"tEXt", b"") * 600 + encode(np.zeros((64, 64, 3), np.uint8))[33:]
    with pytest.raises(ApiError) as err:
        probe_image(hidden, LIMITS)
    assert (err.value.status, err.value.code) == (413, "image_too_complex")


def test_image_data_split_into_tiny_chunks_is_refused_but_real_splits_are_not():
    img = np.random.default_rng(0).integers(0, 255, (300, 300, 3), dtype=np.uint8)
    good = encode(img)
    ihdr_end = 33
    idat = b"".join(good[p + 8:p + 8 + struct.unpack(">I", good[p:p + 4])[0]]
                    for p in _chunk_positions(good) if good[p + 4:p + 8] == b"IDAT")
    tiny = b"".join(_chunk(b"IDAT", idat[i:i + 16]) for i in range(0, len(idat), 16))
    bomb = good[:ihdr_end] + tiny + _chunk(b"IEND", b"")
    with pytest.raises(ApiError) as err:
        probe_image(bomb, LIMITS)
    assert err.value.status == 413 and "under 256 bytes" in err.value.message
    split = b"".join(_chunk(b"IDAT", idat[i:i + 8192]) for i in range(0, len(idat), 8192))
    fine = good[:ihdr_end] + split + _chunk(b"IEND", b"")
    assert (decode_image(fine, LIMITS).rgb == img).all()  # libpng's own 8 kB chunks: decoded exactly


_TEXT_BOMB_CHILD = """
import resource, sys
from tests.images import small_png, text_bomb_png
from services.runtime.codecs.images import DecodeLimits, decode_image
bomb = text_bomb_png(60, kind=sys.argv[1].encode())
decode_image(small_png(), DecodeLimits(40_000_000))   # warm: the codecs' own first-use memory
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rgb = decode_image(bomb, DecodeLimits(40_000_000)).rgb
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grown // 1024, int(rgb.shape[0] * rgb.shape[1]), int(rgb[5, 5, 0]))
"""


@pytest.mark.parametrize("kind", ["zTXt", "iTXt"])
def test_compressed_text_after_the_pixels_never_reaches_the_decoder(kind):
    """60 compressed text chunks after the image data (470 kB), each inflating to 7.9 MB:
    libpng keeps every one it inflates (474 MB for this 48x32 picture; 3.9 GB for 500 chunks,
    which killed the unit). The decoder is handed the file without them: its peak memory,
    measured in a fresh process around one real decode, stays near the picture's."""
    import subprocess
    import sys

    from tests.harness import ROOT
    out = subprocess.run([sys.executable, "-c", _TEXT_BOMB_CHILD, kind], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    grown_mib, pixels, value = map(int, out.stdout.split())
    assert (pixels, value) == (48 * 32, 127)  # the picture itself, decoded
    assert grown_mib < 64, f"decoding a 48x32 PNG took {grown_mib} MiB more"


def test_the_png_walk_finds_compressed_text_anywhere_and_the_probe_keeps_the_rest():
    from tests.images import small_png, text_bomb_png
    bomb = text_bomb_png(3, 10_000)
    shape = formats.walk_png(bomb, 512)
    assert [bomb[s + 4:s + 8] for s, _ in shape.inflating] == [b"zTXt"] * 3
    kept = b"".join(formats.without_spans(bomb, formats.decoder_skips(shape)))
    assert kept == small_png()  # only those chunks go, byte for byte
    assert formats.unneeded_chunks(bomb) == formats.decoder_skips(shape) == probe_image(bomb, LIMITS)._unneeded
    assert formats.decoder_skips(formats.walk_png(small_png(), 512)) == ()  # nothing to leave out: no copy


_MALFORMED_CHUNKS_CHILD = """
import struct, sys, zlib
from tests.images import small_png
from services.runtime.codecs.images import DecodeLimits, decode_image
def chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xffffffff)
base = small_png()
at = base.rfind(b"IEND") - 4
bad = base[:at] + chunk(b"tEXt", b"x") * 500 + base[at:]   # each one 'tEXt: too short' to libpng
rgb = decode_image(bad, DecodeLimits(40_000_000)).rgb
print(int(rgb.shape[0] * rgb.shape[1]), int(rgb[5, 5, 0]))
"""


def test_malformed_ancillary_chunks_never_reach_the_decoder_so_they_log_nothing():
    """libpng writes a line to stderr for each malformed ancillary chunk it reads: 500 in a
    6.6 kB file were 500 lines of the service's log a request. The decoder is shown only the
    chunks it reads."""
    import subprocess
    import sys

    from tests.harness import ROOT
    out = subprocess.run([sys.executable, "-c", _MALFORMED_CHUNKS_CHILD], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(48 * 32), "127"]
    assert "libpng" not in out.stderr, out.stderr[:300]


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "I;16"])
def test_leaving_out_what_the_decoder_does_not_read_changes_no_pixel(mode):
    """Gamma, chromaticities, significant bits, background, sRGB, a profile and text are
    left out (more than a few of them): the pixels are those of the file as it was."""
    import io
    import zlib

    import cv2
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(7)
    arr = rng.integers(0, 255, (40, 50, 3), np.uint8)
    im = Image.fromarray(arr).convert(mode) if mode != "I;16" else Image.fromarray(arr[..., 0].astype(np.uint16) * 257)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    base = buf.getvalue()
    colour = mode in ("RGB", "RGBA", "P")
    extra = (_chunk(b"gAMA", struct.pack(">I", 30000))
             + _chunk(b"cHRM", struct.pack(">8I", 31270, 32900, 64000, 33000, 30000, 60000, 15000, 6000))
             + _chunk(b"sBIT", bytes([5, 6, 5] if colour else [5]))
             + _chunk(b"sRGB", b"\x00") + _chunk(b"iCCP", b"p\0\0" + zlib.compress(b"\0" * 400))
             + b"".join(_chunk(b"tEXt", b"k%d\0v" % k) for k in range(10)))
    dressed = base[:33] + extra + base[33:]
    assert len(formats.decoder_skips(formats.walk_png(dressed, 512))) == 15
    for factor in (1, 2):
        got = decode_image(dressed, LIMITS, max_side=50 // factor).rgb
        plain = cv2.imdecode(np.frombuffer(base, np.uint8),
                             (cv2.IMREAD_REDUCED_COLOR_2 if factor == 2 else cv2.IMREAD_COLOR)
                             | cv2.IMREAD_IGNORE_ORIENTATION)
        assert got.shape[:2] == plain.shape[:2] and (got == plain[..., ::-1]).all()


@pytest.mark.parametrize("kind", ["zTXt", "iTXt"])
def test_compressed_text_before_the_pixels_is_not_inflated_to_read_the_header(monkeypatch, kind):
    """64 chunks of 1 MB of text before the image data, a 65 kB file: Pillow inflated every
    one to open it (0.3-0.5 s of CPU a probe, in the service and again in the jobs service's
    check of a submit). Both header reads now open it without them, with the same answer."""
    import PIL.PngImagePlugin

    from services.jobs.payload import Limits, check_image
    from tests.images import text_bomb_png

    inflated = []
    for name in ("chunk_zTXt", "chunk_iTXt"):
        real = getattr(PIL.PngImagePlugin.PngStream, name)

        def spy(self, pos, length, real=real, name=name):
            inflated.append(name)
            return real(self, pos, length)
        monkeypatch.setattr(PIL.PngImagePlugin.PngStream, name, spy)
    bomb = text_bomb_png(64, 1_000_000, after_pixels=False, kind=kind.encode())
    header = probe_image(bomb, LIMITS)
    assert (header.format, header.width, header.height) == ("PNG", 48, 32)
    assert check_image(bomb, "image", Limits(20 << 20, 40_000_000)) == (48, 32)
    assert inflated == []
    assert (decode_image(bomb, LIMITS).rgb[5, 5, 0]) == 127  # and the picture still decodes


def _chunk_positions(png: bytes):
    pos = 8
    while pos + 8 <= len(png):
        length = struct.unpack(">I", png[pos:pos + 4])[0]
        yield pos
        pos += 12 + length


def test_an_rle_bmp_never_reaches_pillows_pure_python_decoder(monkeypatch):
    """Pillow's RLE decoder is pure Python (20 MB of runs for 2 pixels took 7.5 s); such a
    BMP is decoded by OpenCV's C decoder or refused, never handed to Pillow's."""
    import PIL.BmpImagePlugin

    class Trapped(BaseException):  # not an Exception: nothing on the way may turn it into a 400
        pass

    def trap(*args, **kwargs):
        raise Trapped("Pillow's pure-Python RLE decoder ran")

    monkeypatch.setattr(PIL.BmpImagePlugin.BmpRleDecoder, "decode", trap)
    bomb = rle8_bmp(1, 2, 20_000_000)
    assert formats.bmp_compression(bomb) == "RLE8"
    try:
        img = decode_image(bomb, LIMITS)
        assert img.rgb.shape[:2] == (2, 1)
    except ApiError as exc:   # OpenCV may call the runs corrupt: a 400, never a 5xx
        assert exc.status == 400
    small = rle8_bmp(64, 64, 600)
    try:
        decode_image(small, LIMITS)
    except ApiError as exc:
        assert exc.status == 400


def test_every_exif_orientation_matches_pillows_reading():
    rgb = np.random.default_rng(1).integers(0, 255, (30, 50, 3), dtype=np.uint8)
    for orientation in range(1, 9):
        im = Image.fromarray(rgb)
        exif = im.getexif()
        exif[0x0112] = orientation
        for fmt in ("PNG", "JPEG"):
            buf = io.BytesIO()
            im.save(buf, fmt, exif=exif, **({"quality": 100} if fmt == "JPEG" else {}))
            data = buf.getvalue()
            want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")).astype(int)
            got = decode_image(data, LIMITS)
            assert got.rgb.shape == want.shape and (got.width, got.height) == (want.shape[1], want.shape[0])
            assert np.abs(got.rgb.astype(int) - want).max() <= (0 if fmt == "PNG" else 8), (fmt, orientation)


def test_the_probe_reads_size_and_cost_without_decoding():
    bomb = pixel_bomb_png(6000, 6000)   # a real header, garbage data: decoding would fail
    header = probe_image(bomb, LIMITS)
    assert (header.format, header.width, header.height, header.pixels) == ("PNG", 6000, 6000, 36_000_000)
    with pytest.raises(ApiError) as err:
        decode_image(bomb, LIMITS)
    assert err.value.status == 400


def test_a_big_jpeg_is_decoded_at_reduced_scale_when_the_model_shrinks_it():
    big = np.asarray(Image.fromarray(astronaut()).resize((2048, 2048)))
    data = encode(big, "JPEG", quality=90)
    full = decode_image(data, LIMITS)
    reduced = decode_image(data, LIMITS, max_side=512)
    assert full.rgb.shape == (2048, 2048, 3) and (full.width, full.scale) == (2048, 1.0)
    assert reduced.rgb.shape == (512, 512, 3) and reduced.width == 2048 and reduced.scale == 0.25


def test_base64_as_webui_clients_send_it_mime_wrapped_or_as_a_data_url():
    data = bytes(range(256)) * 50
    text = base64.b64encode(data).decode()
    wrapped = "\r\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    assert decode_base64(wrapped, "x") == data
    assert decode_base64("data:image/png;base64," + text, "x") == data
    for bad in ("not base64!", text[:-1], text + "$"):
        with pytest.raises(ApiError) as err:
            decode_base64(bad, "x")
        assert err.value.status == 400
    big = bytes(np.random.default_rng(2).integers(0, 255, 3_000_000, dtype=np.uint8))
    assert decode_base64(encode_base64(big), "x") == big


def test_an_answer_the_encoder_cannot_write_is_refused_with_the_reason():
    with pytest.raises(ApiError) as err:
        encode_image(np.zeros((8, 16384, 3), np.uint8), "webp")
    assert (err.value.status, err.value.code) == (422, "output_too_large") and "16383" in err.value.message
    png, mime = encode_image(np.zeros((8, 16384, 3), np.uint8), "png")
    assert mime == "image/png" and Image.open(io.BytesIO(png)).size == (16384, 8)


def test_json_answers_splice_big_base64_and_stay_valid_json():
    blob = encode_base64(bytes(200_000))
    doc = {"images": [blob, "plain \u0000 \"quoted\" onecard-splice-0"], "n": 1.5, "nested": {"b": blob}}
    parts = json_parts(doc)
    assert len(parts) > 1 and json.loads(json_bytes(doc)) == json.loads(json.dumps(doc))


def test_a_json_answers_non_finite_numbers_are_null():
    """json.dumps writes NaN and Infinity, which no strict JSON parser reads (a model's score)."""
    blob = encode_base64(bytes(100_000))
    doc = {"score": float("nan"), "box": [float("inf"), -float("inf"), 1.5], "image": blob}
    text = json_bytes(doc).decode()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"score": None, "box": [None, None, 1.5], "image": blob}
    keys = json_bytes({float("nan"): 1, float("inf"): 2, -float("inf"): 3, "image": blob})  # as json.dumps made them
    assert json.loads(keys) == {"NaN": 1, "Infinity": 2, "-Infinity": 3, "image": blob}


def test_an_answers_big_strings_are_freed_by_their_counts_not_left_to_the_collector():
    """Nothing json_parts makes refers to itself: a self-calling closure did, and the cycle kept
    every answer's base64 pictures until a full collection, which the services run rarely
    (four 40 MP extras answers at once: img2img +130 MiB each time, for good)."""
    import gc
    import sys
    blob = encode_base64(bytes(300_000))
    base = sys.getrefcount(blob)
    gc.disable()
    try:
        parts = json_parts({"images": [blob, blob], "nested": {"b": blob}})
        assert len(parts) > 3
        del parts
        assert sys.getrefcount(blob) == base
    finally:
        gc.enable()


def test_json_answers_splice_any_big_string_exactly_as_json_dumps_writes_it():
    """Every big string goes out a slice at a time; slices that need escaping are escaped as
    json.dumps escapes them inside the whole (a character at a time, across slice edges)."""
    from services.runtime.codecs import json_answer
    edge = json_answer.SPLICE_STEP
    tricky = ("a" * (edge - 1) + "\"" + "\\" + "é" * 10 + "\U0001F600" + "\u0000\n\t" + "b" * 70_000)
    doc = {"text": tricky, "ascii": "x" * 200_000, "list": [tricky[::-1], 1], "key \"q\"": "short"}
    assert json_bytes(doc) == json.dumps(doc, separators=(",", ":")).encode()
    assert len(json_parts(doc)) > 4


def _png_chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos + 8 <= len(png):
        length, kind = struct.unpack_from(">I4s", png, pos)
        out.append((kind, png[pos + 8:pos + 8 + length]))
        pos += 12 + length
    return out


def test_a_pngs_header_probe_never_decodes_its_pixels_and_reads_an_exif_chunk_anywhere(monkeypatch):
    """Pillow's getexif() on a PNG whose eXIf chunk does not come before the image data decodes
    the whole picture to look for one (+154 MiB and 0.46 s for a refused 6324 px picture). The
    probe reads the eXIf chunk from its own walk: wherever it is, and never a pixel."""
    import PIL.PngImagePlugin

    class Trapped(BaseException):
        pass

    def trap(self, *args, **kwargs):
        raise Trapped("the PNG was decoded to read its header")

    rgb = np.random.default_rng(3).integers(0, 255, (30, 50, 3), dtype=np.uint8)
    im = Image.fromarray(rgb)
    exif = im.getexif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    im.save(buf, "PNG", exif=exif)
    chunks = _png_chunks(buf.getvalue())
    exif_chunk = next(c for c in chunks if c[0] == b"eXIf")
    moved = [c for c in chunks if c[0] not in (b"eXIf", b"IEND")] + [exif_chunk, (b"IEND", b"")]
    late_exif = b"\x89PNG\r\n\x1a\n" + b"".join(_chunk(kind, body) for kind, body in moved)
    monkeypatch.setattr(PIL.PngImagePlugin.PngImageFile, "load", trap)
    header = probe_image(late_exif, LIMITS)                      # the eXIf chunk after the data
    assert (header.width, header.height, header.orientation) == (30, 50, 6)
    assert probe_image(pixel_bomb_png(6324, 6324), LIMITS).pixels == 6324 * 6324  # no eXIf at all
    monkeypatch.undo()
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue()))).convert("RGB"))
    assert (decode_image(late_exif, LIMITS).rgb == want).all()


def test_an_oversized_or_broken_exif_block_is_ignored_not_refused_and_not_logged(tmp_path):
    """Pillow warns once per broken tag (thousands in one block): in a real process, with
    Python's default warning filters, nothing of it reaches stderr, and the picture is fine."""
    import subprocess
    import sys

    from tests.harness import ROOT
    from tests.images import exif_bomb_jpeg, exif_bomb_png
    (tmp_path / "0.png").write_bytes(exif_bomb_png(tags=4000))   # within the size bound: parsed, warned
    (tmp_path / "1.png").write_bytes(exif_bomb_png())            # 60 000 tags: over the bound, not parsed
    (tmp_path / "2.jpg").write_bytes(exif_bomb_jpeg())
    script = ("import sys; from services.runtime.codecs.images import DecodeLimits, probe_image\n"
              "for p in sys.argv[1:]:\n"
              "    h = probe_image(open(p, 'rb').read(), DecodeLimits(10**8))\n"
              "    print(h.width, h.height, h.orientation)\n")
    out = subprocess.run([sys.executable, "-c", script, *sorted(map(str, tmp_path.iterdir()))], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["64 64 1"] * 3 and "Warning" not in out.stderr, out.stderr


def test_a_header_probed_from_other_bytes_does_not_let_the_text_through(monkeypatch):
    """A header of a plain PNG handed in with a text bomb (the SDK's decode_image(data,
    header)): the bomb's own chunks are found again, not taken from the header."""
    from services.runtime.codecs import images
    from tests.images import small_png, text_bomb_png

    plain = small_png()
    bomb = text_bomb_png(3, 10_000)
    shown = []
    real = images.cv2.imdecode
    monkeypatch.setattr(images.cv2, "imdecode", lambda buf, flags: shown.append(bytes(buf)) or real(buf, flags))
    rgb = images.decode_probed(bomb, probe_image(plain, LIMITS)).rgb
    assert shown == [plain] and rgb[5, 5, 0] == 127
