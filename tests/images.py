"""Real test images: scikit-image's astronaut and coffee, insightface's group photo, and crafted bad ones."""

from __future__ import annotations

import importlib.resources
import io
import struct
import zlib

import numpy as np
from PIL import Image


def encode(arr: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


def astronaut() -> np.ndarray:
    from skimage import data
    return data.astronaut()


def coffee() -> np.ndarray:
    """A photo with no face in it."""
    from skimage import data
    return data.coffee()


def group_photo_jpeg() -> bytes:
    """Six faces; ships inside the insightface wheel."""
    return (importlib.resources.files("insightface") / "data" / "images" / "t1.jpg").read_bytes()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def pixel_bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid PNG header declaring a huge image, with a tiny body."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def small_png() -> bytes:
    return encode(np.full((32, 48, 3), 127, dtype=np.uint8))


def progressive_jpeg(arr: np.ndarray | None = None) -> bytes:
    arr = arr if arr is not None else np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    return encode(arr, "JPEG", progressive=True, quality=90)


def scan_bomb_jpeg(extra_scans: int = 2000) -> bytes:
    """A small progressive JPEG whose last scan is repeated many times: each scan costs
    a decoder a full pass over the image (the 'thousands of scans' attack)."""
    data = progressive_jpeg()
    last_sos = data.rindex(b"\xff\xda")  # 0xFF in entropy data is stuffed (FF00): this is a marker
    scan = data[last_sos:-2]
    return data[:-2] + scan * extra_scans + b"\xff\xd9"


def nested_json(depth: int) -> bytes:
    return b'{"image": ' + b"[" * depth + b"]" * depth + b"}"


def exif_rotated_jpeg(arr: np.ndarray, orientation: int) -> bytes:
    """A JPEG whose stored pixels are `arr`, with an EXIF orientation tag."""
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


# ---- crafted attack files (the hostile-client replay: bench/attack_soak.py, test_attack_replay.py) ----

def flat_png(width: int, height: int, level: int = 9) -> bytes:
    """One colour: PNG shrinks 6324x6324 to about 50 KB that decodes to 120 MB (a pixel bomb
    within max_pixels)."""
    import cv2
    ok, out = cv2.imencode(".png", np.zeros((height, width, 3), np.uint8), [cv2.IMWRITE_PNG_COMPRESSION, level])
    assert ok
    return out.tobytes()


def bad_crc_png(width: int, height: int, color_type: int = 6) -> bytes:
    """One colour, 8 bits a channel, whose last image-data chunk fails its checksum: libpng
    (OpenCV) refuses it at the end, Pillow reads it."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color_type]
    compressor = zlib.compressobj(9)
    row = b"\x00" + b"\x80" * (width * channels)
    data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    pieces = [data[i:i + 65536] for i in range(0, len(data), 65536)]
    out = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0))
    out += b"".join(_chunk(b"IDAT", p) for p in pieces[:-1])
    last = _chunk(b"IDAT", pieces[-1])
    return out + last[:-4] + bytes(b ^ 0xFF for b in last[-4:]) + _chunk(b"IEND", b"")


def flat_jpeg(width: int, height: int) -> bytes:
    import cv2
    ok, out = cv2.imencode(".jpg", np.full((height, width, 3), 128, np.uint8), [cv2.IMWRITE_JPEG_QUALITY, 50])
    assert ok
    return out.tobytes()


def flat_webp(width: int, height: int) -> bytes:
    """Lossless WebP of one colour: a few kB for up to 16383 px a side."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, "WEBP", lossless=True, quality=0, method=0)
    return buf.getvalue()


def noisy_png(width: int, height: int, noisy_rows: float = 1.0, seed: int = 0) -> bytes:
    """Random pixels in the first `noisy_rows` share of the rows (incompressible), the rest flat:
    sets the file size between almost nothing and the raw size."""
    import cv2
    arr = np.zeros((height, width, 3), np.uint8)
    n = int(height * noisy_rows)
    arr[:n] = np.random.default_rng(seed).integers(0, 256, (n, width, 3), dtype=np.uint8)
    ok, out = cv2.imencode(".png", arr, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    assert ok
    return out.tobytes()


def _bmp(width: int, height: int, bpp: int, compression: int, palette: int, data: bytes) -> bytes:
    offset = 14 + 40 + 4 * palette
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, bpp, compression, len(data), 2835, 2835, palette, 0)
    head = b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset)
    return head + info + b"\x00\x00\x00\x00" * palette + data


def rle8_bmp_bomb(total_bytes: int = 20_000_000, width: int = 1, height: int = 2) -> bytes:
    """A 1x2 RLE8 BMP whose stream is millions of zero-distance 'delta' escapes: each costs a
    pure-Python decoder (Pillow's) one loop turn and produces nothing."""
    n = max(0, total_bytes - 200) // 4
    return _bmp(width, height, 8, 1, 256, b"\x00\x02\x00\x00" * n + b"\x00\x01")


def rle4_bmp(width: int = 6324, height: int = 6324) -> bytes:
    """A 40-megapixel RLE4 BMP in about 0.3 MB (runs of 255 pixels)."""
    row = b"\xff\x11" * (width // 255) + (bytes([width % 255, 0x11]) if width % 255 else b"") + b"\x00\x00"
    return _bmp(width, height, 4, 2, 16, row * height + b"\x00\x01")


def png_chunk_bomb(chunks: int = 1_580_000) -> bytes:
    """A 64x64 PNG carrying `chunks` empty IDAT chunks before its real data (19 MB for 1.58 M)."""
    small = flat_png(64, 64)
    empty = _chunk(b"IDAT", b"")
    return small[:33] + empty * chunks + small[33:]


def text_bomb_png(chunks: int = 500, each: int = 7_900_000, after_pixels: bool = True,
                  kind: bytes = b"zTXt") -> bytes:
    """A 48x32 PNG with `chunks` compressed text chunks (zTXt, or iTXt with its compression
    flag set), each `each` bytes of one letter compressed to about a thousandth of that:
    a decoder that keeps a picture's text inflates them all. After the pixels (the default)
    they are out of sight of a reader that stops at the image data."""
    z = zlib.compress(b"a" * each, 9)
    body = b"parameters\0\0" + z if kind == b"zTXt" else b"parameters\0\1\0\0\0" + z
    base = small_png()
    at = base.rfind(b"IEND") - 4 if after_pixels else 33
    return base[:at] + _chunk(kind, body) * chunks + base[at:]


def icc_bomb_png(chunks: int = 500, each: int = 1_000_000) -> bytes:
    """A 48x32 PNG with `chunks` iCCP chunks before its pixels, each `each` zero bytes
    compressed to about a thousandth of that: Pillow inflates every one it meets (up to 1 MB
    each, no total); libpng stops at the profile's header, which declares no length."""
    base = small_png()
    return base[:33] + _chunk(b"iCCP", b"icc\0\0" + zlib.compress(b"\0" * each, 9)) * chunks + base[33:]


def _tiff_ifd(entries: list[tuple[int, int, int, int]], tail: bytes = b"") -> bytes:
    """A little-endian TIFF: one IFD of (tag, type, count, value/offset) entries, then `tail`."""
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + b"\x00" * 4
    return b"II*\x00" + struct.pack("<I", 8) + ifd + tail


def exif_bomb_tiff(tags: int, blob: int) -> bytes:
    """EXIF whose every tag (UNDEFINED, `blob` bytes) points at the same data: a reader that
    copies each tag's data reads tags x blob bytes from a file of blob bytes."""
    data_at = 8 + 2 + 12 * tags + 4
    return _tiff_ifd([(0x0200 + i, 7, blob, data_at) for i in range(tags)], b"\x00" * blob)


def exif_bomb_png(tags: int = 60_000, blob: int = 256) -> bytes:
    """A 64x64 PNG with an eXIf chunk of `tags` overlapping tags (before its image data)."""
    small = flat_png(64, 64)
    return small[:33] + _chunk(b"eXIf", exif_bomb_tiff(tags, blob)) + small[33:]


def exif_bomb_jpeg(tags: int = 5_000, blob: int = 4_000) -> bytes:
    """A 64x64 JPEG whose APP1 segment (64 KB at most) holds as many overlapping tags as fit."""
    tiff = exif_bomb_tiff(tags, blob)
    while len(tiff) + 8 > 65535:
        tags = tags * 9 // 10
        tiff = exif_bomb_tiff(tags, blob)
    jpg = flat_jpeg(64, 64)
    app1 = b"Exif\x00\x00" + tiff
    return jpg[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + jpg[2:]


def webp_animation(canvas: tuple[int, int] = (6324, 6324), frames: int = 5000) -> bytes:
    """An animated WebP: a canvas of up to 40 MP and thousands of 16x16 frames (each frame a
    decoder composes costs it the whole canvas), in a few hundred kB."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, "WEBP", lossless=True)
    riff = buf.getvalue()
    vp8l = riff[12:]  # the VP8L chunk, header included
    vp8l = vp8l[:8 + struct.unpack_from("<I", vp8l, 4)[0] + (struct.unpack_from("<I", vp8l, 4)[0] & 1)]

    def wchunk(kind: bytes, data: bytes) -> bytes:
        return kind + struct.pack("<I", len(data)) + data + (b"\x00" if len(data) & 1 else b"")

    def u24(v: int) -> bytes:
        return struct.pack("<I", v)[:3]

    w, h = canvas
    vp8x = bytes([0x02, 0, 0, 0]) + u24(w - 1) + u24(h - 1)
    anim = b"\x00\x00\x00\x00" + struct.pack("<H", 0)
    body = wchunk(b"VP8X", vp8x) + wchunk(b"ANIM", anim)
    for i in range(frames):
        x, y = (i * 16) % max(16, w - 16), ((i * 16) // max(16, w - 16) * 16) % max(16, h - 16)
        anmf = u24(x // 2) + u24(y // 2) + u24(15) + u24(15) + u24(1) + b"\x00" + vp8l
        body += wchunk(b"ANMF", anmf)
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def tiny_containers_json(total_bytes: int, image: bytes | None = None, kind: bytes = b"[]") -> bytes:
    """A JSON object of `total_bytes` whose bulk is millions of empty arrays (or objects): 3 bytes
    on the wire, 56 to 64 bytes each once parsed, and a parser that holds the GIL throughout."""
    import base64
    head = b'{"image": "' + base64.b64encode(image or small_png()) + b'", "x": ['
    n = max(1, (total_bytes - len(head) - 2) // (len(kind) + 1))
    return head + (kind + b",") * (n - 1) + kind + b"]}"
