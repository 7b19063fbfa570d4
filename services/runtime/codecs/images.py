"""Images in and out, with the cost of a decode bounded by limits checked before it.

Only JPEG, PNG, WebP and BMP are opened (415 for anything else, so that no exotic
decoder ever sees a caller's bytes). ``probe_image`` reads what a request will cost from
the header alone: dimensions (413 for a pixel bomb), and the structure a decoder would
walk (JPEG scans and segments, PNG chunks: 413 for a scan or chunk bomb); the caller
states the cost (cost.py) and only then ``decode_image`` decodes. Decoding is OpenCV's
(libjpeg-turbo, libpng, libwebp in C, which release the GIL for the whole decode, so the
event loop and the probes stay prompt while big pictures decode in the CPU pool);
Pillow reads headers and EXIF. A JPEG that the model will shrink anyway is decoded at
reduced scale (DCT scaling), for a fraction of the cost. EXIF orientation is applied, so
pixels are as the camera meant them. Everything here is CPU work: the runtime calls it in
its executor, never on the event loop.
"""

from __future__ import annotations

import io
import math
import numbers
import warnings
from dataclasses import dataclass

import cv2
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from services.runtime.codecs import exif, jpeg
from services.runtime.codecs import png_bmp as formats
from services.runtime.codecs.encoder_limits import SMALL_WEBP_PIXELS, check_encodable
from services.runtime.codecs.exif_segments import jpeg_pieces, webp_pieces
from services.runtime.codecs.fresh_bytes import joined
from services.runtime.codecs.page_release import hand_back_pages
from services.runtime.codecs.pil_arrays import array_of
from services.runtime.codecs.png_encode import encode_png
from services.runtime.codecs.webp_header import WebpHeaderError, WebpLimitError, is_webp, read_header
from services.runtime.codecs.webp_tables import lossless_table_bytes
from services.runtime.errors import ApiError

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP")
# Pillow reads some files OpenCV refuses (a PNG whose image data fails its checksum, rare
# variants), but only whole, at full size and in the file's own mode beside the RGB copy: up
# to 7 bytes a pixel where the cost model charged 3, and no reduced decode (eight 6324x6324
# RGBA PNGs with a bad last CRC took detect 160 MiB past its budget). It is the fallback for
# pictures up to this size; a bigger one OpenCV refuses is a 400.
PILLOW_FALLBACK_MAX_PIXELS = 1 << 22
# below this, Pillow's faster WebP encoder holds the GIL for a few ms at most (19 ms a megapixel)
PILLOW_WEBP_MAX_PIXELS = SMALL_WEBP_PIXELS
# OpenCV decodes an animation by composing its first frame on a full RGBA canvas, beside
# the previous one: with the RGB copy, what decoding holds at its peak, measured against the
# picture's RGB size (3 bytes a pixel): WebP 11 bytes a pixel, APNG up to 15 (RGBA frames)
ANIMATED_DECODE_FACTOR = {"WEBP": 4, "PNG": 5}
OUTPUT_FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg"), "webp": ("WEBP", "image/webp")}
MIME_TO_FORMAT = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/webp": "webp"}
# our own pixel check runs first; PIL's must not raise a different error for the same thing
Image.MAX_IMAGE_PIXELS = None
# a caller's EXIF block with thousands of broken tags makes Pillow warn once per tag: that
# is the caller's data, not the service's log (26 MB of log for 17 requests, and a registry
# of warnings that grows)
warnings.filterwarnings("ignore", module=r"PIL\.")
MAX_EXIF_BYTES = 64 * 1024  # a JPEG's APP1 segment cannot be larger; PNG and WebP are held to the same
# a caller's broken file is a 400, not a line in the service's log (a flood of them would be a log flood)
cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM")
_REDUCED = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}


@dataclass(frozen=True)
class DecodeLimits:
    max_pixels: int
    max_jpeg_scans: int = 32
    max_image_markers: int = 512


@dataclass(frozen=True)
class ImageHeader:
    """What a picture will cost, read without decoding it."""
    format: str
    width: int           # as oriented (EXIF applied)
    height: int
    orientation: int = 1
    animated: bool = False

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def decode_pixels(self) -> int:
        """What decoding it holds at its peak, in RGB pixels (the unit of the cost model's
        input pixels): the picture, and besides it whichever is more of a second copy of it
        (OpenCV hands its result to Python as a copy, and an EXIF turn copies it again) and
        the decoder's own buffers, freed before that copy: an animation's (WebP, APNG) RGBA
        canvases, a lossless WebP's Huffman tables (webp_tables), a progressive JPEG's
        coefficients (jpeg.JpegShape.coefficient_bytes). A 2400x2400 JPEG held 6.0 bytes a
        pixel where 3 were charged."""
        canvases = self.pixels * (ANIMATED_DECODE_FACTOR.get(self.format, 1) - 1 if self.animated else 0)
        own = canvases + -(-getattr(self, "_decoder_bytes", 0) // 3)
        return self.pixels + max(self.pixels, own)


@dataclass
class DecodedImage:
    rgb: np.ndarray      # H x W x 3, uint8; possibly reduced (see scale)
    width: int           # the image's size as oriented, before any reduction
    height: int
    format: str
    scale: float = 1.0   # rgb width / width: < 1 when decoded at reduced scale


def _looks_allowed(data: bytes) -> bool:
    return data.startswith(_SIGNATURES) or is_webp(data)


def probe_image(data: bytes, limits: DecodeLimits) -> ImageHeader:
    """Format, size and orientation from the header; 413 for what would cost too much to decode."""
    if not data:
        raise ApiError(400, "empty_image", "the image is empty")
    png = jpg = None
    source = data
    try:
        if data[:2] == b"\xff\xd8":
            jpg = jpeg.walk(data, limits.max_jpeg_scans, limits.max_image_markers)
            source = jpeg.header_for_pillow(data, jpg)
        elif data[:8] == formats.PNG_SIGNATURE:
            png = formats.walk_png(data, limits.max_image_markers)
            source = formats.header_for_pillow(data, png)
    except (jpeg.JpegLimitError, formats.FormatLimitError) as exc:
        raise ApiError(413, "image_too_complex", f"{exc}: decoding it would cost too much") from None
    if is_webp(data):  # read here: Pillow would copy the whole file twice, holding the GIL
        try:
            webp = read_header(data)
        except WebpHeaderError as exc:
            raise ApiError(400, "corrupt_image", f"the image header is corrupt: {exc}") from None
        except WebpLimitError as exc:
            raise ApiError(413, "image_too_complex", f"{exc}: decoding it would cost too much") from None
        fmt, width, height, animated = "WEBP", webp.width, webp.height, webp.animated
        _check_pixels(width, height, limits)
        orientation = _orientation_of(webp.exif, webp.xmp, png=False)
    else:
        try:
            im = Image.open(io.BytesIO(source), formats=ALLOWED_FORMATS)
        except UnidentifiedImageError:
            if _looks_allowed(data):  # the right magic bytes, broken inside
                raise ApiError(400, "corrupt_image", "the image header is corrupt") from None
            raise ApiError(415, "unsupported_image",
                           f"not an image in one of {', '.join(ALLOWED_FORMATS)}") from None
        except Exception as exc:  # noqa: BLE001 - any decoder failure is the caller's bad data
            raise ApiError(400, "corrupt_image", f"cannot read the image header: {exc}") from None
        with im:
            width, height = im.size
            _check_pixels(width, height, limits)
            orientation = _orientation(im, png, jpg)
            fmt = im.format or ""
            animated = _animated(data, fmt, png)
    if orientation not in range(1, 9):
        orientation = 1
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    header = ImageHeader(fmt, width, height, orientation, animated)
    # the PNG chunks decode_probed leaves out: kept beside the public fields (their signature
    # is the API's), found again there for a header built elsewhere
    object.__setattr__(header, "_unneeded", formats.decoder_skips(png) if png is not None and fmt == "PNG" else ())
    object.__setattr__(header, "_probed", _fingerprint(data))
    if fmt == "WEBP":  # (as a pixel is counted: 3 bytes of the cost model's input pixels)
        object.__setattr__(header, "_decoder_bytes", lossless_table_bytes(data, width, height))
    elif jpg is not None:
        object.__setattr__(header, "_decoder_bytes", jpg.coefficient_bytes)
    return header


def _fingerprint(data: bytes) -> tuple[int, bytes, bytes]:
    """Enough of a picture to tell whether a header was probed from these bytes (a header of
    one picture handed in with another would let the other's chunks through)."""
    return len(data), bytes(data[:64]), bytes(data[-64:])


def _animated(data: bytes, fmt: str, png: formats.PngShape | None) -> bool:
    """Marked as an animation, however many frames it has: a one-frame animation is composed
    on its full canvas all the same (a 94-byte WebP of 6324x6324 held 419 MiB to decode).
    PNG: an acTL chunk (WebP: the VP8X header's animation flag, webp_header)."""
    return fmt == "PNG" and png is not None and png.animated


def _check_pixels(width: int, height: int, limits: DecodeLimits) -> None:
    if width <= 0 or height <= 0:
        raise ApiError(400, "corrupt_image", "the image has no pixels")
    if width * height > limits.max_pixels:
        raise ApiError(413, "too_many_pixels",
                       f"{width}x{height} = {width * height} pixels is over the limit of {limits.max_pixels}")


def _orientation(im: Image.Image, png: formats.PngShape | None, jpg: jpeg.JpegShape | None) -> int:
    """The EXIF orientation, read without decoding a pixel and within bounds
    (services.runtime.codecs.exif): a PNG's from its eXIf chunk, a JPEG's from the block its
    walk found, a WebP's from Pillow's header parse; a JPEG's or WebP's from its XMP packet
    when the EXIF block has no orientation entry, as Pillow's getexif() does. An EXIF block
    over MAX_EXIF_BYTES, or a broken one, is not worth refusing the picture for: orientation 1."""
    if png is not None:
        raw = png.exif
    elif jpg is not None:
        raw = jpg.exif
    else:
        raw = im.info.get("exif")
    return _orientation_of(raw, im.info.get("xmp"), png=png is not None)


def _orientation_of(raw: object, xmp: object, png: bool) -> int:
    if raw is not None and (not isinstance(raw, bytes) or len(raw) > MAX_EXIF_BYTES):
        return 1
    found = exif.orientation_entry(raw)
    if found is None and not png:
        return exif.xmp_orientation(xmp if isinstance(xmp, bytes) else None)
    return found or 1


def reduction_for(header: ImageHeader, max_side: int | None) -> int:
    """The reduction (1, 2, 4, 8) a picture can be decoded at and still have max_side on its
    long side. A JPEG's is exact (the DCT's own scaling). Other formats are decoded whole and
    then shrunk by OpenCV inside the same call, with the GIL released: by 2 at most, which
    its linear resize makes an exact 2x2 average. That keeps the full-size picture off the
    GIL: OpenCV hands its result to Python as a copy and frees the original holding the GIL
    (2.8 ms for 12 MP, stretched to tens under load while the event loop waited), 4x less
    for the reduced one."""
    if not max_side:
        return 1
    # (OpenCV halves a side by integer division and refuses a side of 0 pixels)
    top = 8 if header.format == "JPEG" else 2 if min(header.width, header.height) >= 2 else 1
    factor = 1
    while factor < top and max(header.width, header.height) >= 2 * factor * max_side:
        factor *= 2
    return factor


_ORIENT = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, 3),
    7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
    8: lambda a: np.rot90(a, 1),
}


def _orient(rgb: np.ndarray, orientation: int) -> np.ndarray:
    """EXIF orientation 2..8 as flips and quarter turns, as PIL's exif_transpose does."""
    turn = _ORIENT.get(orientation)
    return rgb if turn is None else np.ascontiguousarray(turn(rgb))


def _decode_pillow(data: bytes, header: ImageHeader) -> np.ndarray:
    im = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    im.load()
    if header.orientation != 1:
        im = ImageOps.exif_transpose(im)
    if im.mode != "RGB":
        im = im.convert("RGB")  # the file's own mode is let go before the array's copy
    return array_of(im)


def decode_probed(data: bytes, header: ImageHeader, max_side: int | None = None) -> DecodedImage:
    """Decode a picture whose header was probed (and whose cost was accepted)."""
    factor = reduction_for(header, max_side)
    spans = getattr(header, "_unneeded", None)
    if header.format == "PNG" and (spans is None or getattr(header, "_probed", None) != _fingerprint(data)
                                   or not formats.spans_are_unneeded(data, spans)):
        spans = formats.unneeded_chunks(data)  # a header built elsewhere, or probed from other bytes
    if spans:  # the decoder is shown the picture without them; the copy goes a megabyte at a time in the GIL lane
        pieces = formats.without_spans(data, spans)
        data = joined(pieces, sum(len(p) for p in pieces))
    flags = (_REDUCED[factor] if factor > 1 else cv2.IMREAD_COLOR) | cv2.IMREAD_IGNORE_ORIENTATION
    try:
        bgr = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
        if bgr is not None:
            # in place: a second picture-sized array would be held beside the first
            rgb = _orient(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB, dst=bgr), header.orientation)
        elif formats.bmp_compression(data):  # Pillow's RLE decoder is pure Python: no second try
            raise ApiError(400, "corrupt_image", "cannot decode the BMP image")
        elif header.format == "WEBP":  # both are libwebp; Pillow's plugin copies the file twice holding the GIL
            raise ApiError(400, "corrupt_image", "cannot decode the WebP image")
        elif header.pixels > PILLOW_FALLBACK_MAX_PIXELS:
            raise ApiError(400, "corrupt_image", "cannot decode the image: it is broken, or a variant only the "
                           f"fallback decoder reads, which takes pictures of at most {PILLOW_FALLBACK_MAX_PIXELS} "
                           "pixels")
        else:  # what OpenCV cannot read (some rare variants), Pillow may: within the bound above
            rgb = _decode_pillow(data, header)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ApiError(400, "corrupt_image", f"cannot decode the image: {str(exc)[:200]}") from None
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.size == 0:
        raise ApiError(400, "corrupt_image", "cannot decode the image")
    return DecodedImage(rgb, header.width, header.height, header.format, rgb.shape[1] / header.width)


def decode_image(data: bytes, limits: DecodeLimits, max_side: int | None = None) -> DecodedImage:
    """Probe and decode, within limits; `max_side` lets a big picture decode at reduced scale
    (reduction_for; never below max_side on its long side: the caller resizes the rest of the way). Callers that
    must state the cost first use probe_image, then decode_probed."""
    return decode_probed(data, probe_image(data, limits), max_side)


def accepted(accept: str) -> list[str]:
    """The media ranges an Accept header names, most wanted first: by q, then in the order
    given; those of q=0 (refused) left out. A q that is no number counts as 1."""
    ranges = []
    for i, item in enumerate(accept.split(",")):
        mime, *params = item.split(";")
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 1.0
                q = 1.0 if q != q else max(0.0, min(1.0, q))  # NaN: no number; -inf: refused
        if q > 0 and mime.strip():
            ranges.append((-q, i, mime.strip().lower()))
    return [mime for _, _, mime in sorted(ranges)]


def choose_format(asked: str | None, accept: str, default: str = "png") -> str:
    """The output format: the one asked for, else the image type Accept wants most."""
    if asked:
        return asked
    return next((MIME_TO_FORMAT[m] for m in accepted(accept) if m in MIME_TO_FORMAT), default)


def prefers_json(accept: str) -> bool:
    """Whether Accept wants application/json before any picture (image/png, image/*, */*):
    "application/json, */*" does, "application/json;q=0, image/png" and
    "application/json-seq" do not."""
    for mime in accepted(accept):
        if mime == "application/json":
            return True
        if mime in MIME_TO_FORMAT or mime in ("image/*", "*/*"):
            return False
    return False


# zlib's run-length strategy with the "up" filter on every row: 2.2x faster than level 1's
# defaults (512x512 photo 6.2 against 13.6 ms; noise 4.4 against 18.4) and the files come out
# smaller or the same (photo 443 against 464 kB, text 18 against 22 kB, gradient 2 against 5).
# Adaptive per-row filtering is what cost the time
PNG_PARAMS = [cv2.IMWRITE_PNG_COMPRESSION, 1, cv2.IMWRITE_PNG_STRATEGY, cv2.IMWRITE_PNG_STRATEGY_RLE,
              cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_UP]


def _check_encode_arguments(rgb: object, fmt: object, quality: object) -> None:
    """A service's misuse said in its own words, before an encoder's (OpenCV's "bad argument",
    an AttributeError, a quality of 0 taken for the default)."""
    if fmt not in OUTPUT_FORMATS:
        raise ValueError(f"cannot encode as {fmt!r}: the formats are {', '.join(sorted(OUTPUT_FORMATS))}")
    if quality is not None and fmt != "png" and (not isinstance(quality, numbers.Real) or (
            not isinstance(quality, numbers.Integral) and not math.isfinite(quality))):
        raise ValueError(f"quality is a number (1 to 100), not {quality!r}")
    if isinstance(rgb, Image.Image):
        width, height = rgb.size
    elif isinstance(rgb, np.ndarray) and rgb.ndim in (2, 3):
        height, width = rgb.shape[:2]
    else:
        raise ValueError(f"a picture is a Pillow image or a height x width (x channels) array, not "
                         f"{type(rgb).__name__}{getattr(rgb, 'shape', '')}")
    if width < 1 or height < 1:
        raise ValueError(f"cannot encode an empty picture ({width}x{height})")


def _quality(quality: float | None, fmt: str) -> int | None:
    """As it always was taken (API 1.x): rounded, 0 for the format's default, clamped to
    1..100; PNG has none."""
    if quality is None or fmt == "png":
        return None
    return None if quality == 0 else min(100, max(1, round(quality)))


def encode_image(rgb: np.ndarray | Image.Image, fmt: str, quality: int | None = None,
                 texts: dict[str, str] | None = None, exif: bytes | None = None) -> tuple[bytes, str]:
    """Encoder settings favour speed: PNG at the lowest compression level with run-length
    matching, WebP at its fastest method; JPEG quality 90 unless asked. `rgb` is an array
    (height x width x 3, uint8) or a Pillow picture (taken as RGB, a slice of rows at a
    time: np.asarray held the GIL 82 ms for 40 MP). `texts`: PNG text chunks (keyword: text),
    tEXt or iTXt as Pillow writes them, right after the header. `exif`: an EXIF block for a
    JPEG or WebP answer (Image.Exif().tobytes()), put in as Pillow and libwebp write it."""
    _check_encode_arguments(rgb, fmt, quality)
    quality = _quality(quality, fmt)
    if texts and fmt != "png":
        raise ValueError(f"text chunks are for PNG answers, not {fmt!r}")
    if exif:
        if fmt not in ("jpeg", "webp"):
            raise ValueError(f"an EXIF block is for JPEG and WebP answers, not {fmt!r}")
        data, mime = encode_image(rgb, fmt, quality)
        pieces = jpeg_pieces(data, exif) if fmt == "jpeg" else webp_pieces(data, exif)
        return joined(pieces, sum(len(p) for p in pieces)), mime
    if isinstance(rgb, Image.Image):
        rgb = array_of(rgb if rgb.mode == "RGB" else rgb.convert("RGB"))
    pil_fmt, mime = OUTPUT_FORMATS[fmt]
    check_encodable(rgb.shape[1], rgb.shape[0], fmt)
    if pil_fmt == "WEBP" and rgb.shape[0] * rgb.shape[1] <= PILLOW_WEBP_MAX_PIXELS:
        buf = io.BytesIO()  # (quality within 1..100 as OpenCV's is below: not an error at one size only)
        Image.fromarray(rgb).save(buf, format=pil_fmt, quality=min(100, max(1, quality or 85)), method=0)
        return buf.getvalue(), mime
    if pil_fmt == "PNG" and rgb.ndim == 3 and rgb.shape[2] == 3 and rgb.dtype == np.uint8:
        # the same file as OpenCV's with PNG_PARAMS, without its GIL-held copy; other pixels
        # (RGBA, 16-bit, float, gray: what this took before) are OpenCV's, as they were
        return encode_png(rgb, texts), mime
    if texts:
        raise ValueError("text chunks are written with 8-bit RGB pixels only")
    # OpenCV's encoders release the GIL for the whole picture. Pillow's WebP encoder holds it
    # (80 ms at 40 MP froze the event loop and the probes that long), so bigger WebP answers
    # go here too, at about 3x Pillow's CPU (OpenCV has no fastest-method setting), which the
    # worker's lower priority absorbs
    ext, params = {"PNG": (".png", PNG_PARAMS), "JPEG": (".jpg", [cv2.IMWRITE_JPEG_QUALITY, quality or 90]),
                   "WEBP": (".webp", [cv2.IMWRITE_WEBP_QUALITY, min(100, max(1, quality or 85))])}[pil_fmt]
    # The temporaries (the BGR copy, the encoder's output) hand their pages back before they
    # are freed: OpenCV's arrays are numpy's, and freeing 36 MB unmapped it with the GIL held
    garbage = [cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)]
    ok, out = cv2.imencode(ext, garbage[0], params)
    hand_back_pages(garbage)
    garbage.clear()
    if not ok:
        raise RuntimeError(f"cannot encode a {rgb.shape[1]}x{rgb.shape[0]} picture as {fmt}")
    data = array_bytes(out)
    garbage.append(out)
    del out
    hand_back_pages(garbage)
    return data, mime


def resize_image(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``rgb`` (height x width x 3, uint8) at ``size`` (width, height): Lanczos when it grows,
    area averaging when it shrinks. OpenCV releases the GIL for the whole picture; Pillow's
    resize did too, but handing its 12 MP result to numpy (``np.asarray``) copied 36 MB a
    slice at a time with the GIL held, and freeing it unmapped 48 MB the same way: the event
    loop and its probes waited behind every big answer."""
    width, height = size
    if width <= 0 or height <= 0:
        raise ValueError(f"cannot resize to {width}x{height}")
    if (rgb.shape[1], rgb.shape[0]) == (width, height):
        return rgb
    shrinks = width * height < rgb.shape[0] * rgb.shape[1]
    return cv2.resize(np.ascontiguousarray(rgb), (width, height),
                      interpolation=cv2.INTER_AREA if shrinks else cv2.INTER_LANCZOS4)


def array_bytes(array: np.ndarray) -> bytes:
    """An encoder's output as bytes, copied a slice at a time in the GIL lane into the
    object returned: ``tobytes()`` copied a 27 MB PNG in one go with the GIL held."""
    flat = memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B")
    if len(flat) < 1 << 20:
        return flat.tobytes()
    return joined([flat], len(flat))
