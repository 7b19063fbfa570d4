"""The webui's infotext: the generation parameters text it writes into every picture,
reads back with ``/sdapi/v1/png-info``, and takes as a request's ``infotext`` field.

Written as the webui writes it (the prompt, ``Negative prompt: ...``, then one line of
``Key: value`` pairs, a value quoted as JSON when it holds a comma, a colon or a line
break); in a PNG as the ``parameters`` text chunk, in a JPEG or WebP as the EXIF
UserComment (``UNICODE`` and UTF-16). Parsed as the webui parses it, in one linear
pass: the webui's regular expression backtracks quadratically on a long line without a
colon, which a client controls here.
"""

from __future__ import annotations

import io
import json
import re
import struct
from typing import Any

from PIL import Image

EXIF_IFD, USER_COMMENT = 0x8769, 0x9286
UNICODE_PREFIX = b"UNICODE\x00"
# what the webui drops from a picture's info before answering png-info
_IGNORED_INFO_KEYS = {"jfif", "jfif_version", "jfif_unit", "jfif_density", "dpi", "exif", "loop", "background",
                      "timestamp", "duration", "progressive", "progression", "icc_profile", "chromaticity",
                      "photoshop"}
_SIZE = re.compile(r"(\d+)x(\d+)")
_WORD = re.compile(r"\w")
_KEY_RUN = re.compile(r"[\w \-/]+")
_QUOTED = re.compile(r'"(?:\\.|[^\\"])+"')


def quote(value: Any) -> str:
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def _unquote(text: str) -> str:
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _pairs(line: str) -> list[tuple[str, str]]:
    """What the webui's ``\\s*(\\w[\\w \\-/]+):\\s*("(?:\\\\.|[^\\\\"])+"|[^,]*)(?:,|$)`` finds in
    `line`, linearly. A key is a run of word characters, spaces, '-' and '/' that starts
    with a word character and ends at a colon; a run that ends anywhere else holds no key
    at any of its positions, so the scan skips it whole."""
    out = []
    i, n = 0, len(line)
    while i < n:
        run = _KEY_RUN.search(line, i)
        if run is None:
            break
        start, j = run.span()
        word = _WORD.search(line, start, j)  # a key starts at its run's first word character
        start = j if word is None else word.start()
        if j >= n or line[j] != ":" or j - start < 2:
            i = j
            continue
        key = line[start:j]
        k = j + 1
        while k < n and line[k].isspace():
            k += 1
        quoted = _QUOTED.match(line, k) if k < n and line[k] == '"' else None
        if quoted is not None and (quoted.end() == n or line[quoted.end()] == ","):
            value, end = quoted.group(), quoted.end()
        else:
            comma = line.find(",", k)
            end = n if comma < 0 else comma
            value = line[k:end]
        out.append((key, value))
        i = end + 1 if end < n else n
    return out


def parse(text: str) -> dict[str, Any]:
    """The webui's parse_generation_parameters: Prompt, Negative prompt, each Key: value
    (Size-1 and Size-2 for a WxH value), and the defaults the webui fills in."""
    res: dict[str, Any] = {}
    *lines, last = text.strip().split("\n")
    pairs = _pairs(last)
    if len(pairs) < 3:
        lines.append(last)
        pairs = []
    prompt, negative, in_negative = [], [], False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            in_negative = True
            line = line[16:].strip()
        (negative if in_negative else prompt).append(line)
    res["Prompt"] = "\n".join(prompt)
    res["Negative prompt"] = "\n".join(negative)
    for key, value in pairs:
        value = _unquote(value)
        size = _SIZE.fullmatch(value)
        if size is not None:
            res[f"{key}-1"], res[f"{key}-2"] = size.group(1), size.group(2)
        else:
            res[key] = value
    for key, default in (("Clip skip", "1"), ("Hires resize-1", 0), ("Hires resize-2", 0),
                         ("Hires sampler", "Use same sampler"), ("Hires schedule type", "Use same scheduler"),
                         ("Hires checkpoint", "Use same checkpoint"), ("Hires prompt", ""),
                         ("Hires negative prompt", ""), ("Mask mode", "Inpaint masked"), ("Masked content", "original"),
                         ("Inpaint area", "Whole picture"), ("Masked area padding", 32), ("RNG", "GPU"),
                         ("Schedule type", "Automatic"), ("Schedule max sigma", 0), ("Schedule min sigma", 0),
                         ("Schedule rho", 0), ("VAE Encoder", "Full"), ("VAE Decoder", "Full"),
                         ("FP8 weight", "Disable"), ("refiner_switch_by_sample_steps", False)):
        res.setdefault(key, default)
    return res


# infotext label -> (request field, type), as the webui pastes an infotext into a request
_FIELDS = {"Prompt": ("prompt", str), "Negative prompt": ("negative_prompt", str), "Steps": ("steps", int),
           "Sampler": ("sampler_name", str), "Schedule type": ("scheduler", str), "CFG scale": ("cfg_scale", float),
           "Seed": ("seed", int), "Variation seed": ("subseed", int),
           "Variation seed strength": ("subseed_strength", float), "Seed resize from-1": ("seed_resize_from_w", int),
           "Seed resize from-2": ("seed_resize_from_h", int), "Size-1": ("width", int), "Size-2": ("height", int),
           "Denoising strength": ("denoising_strength", float), "Mask blur": ("mask_blur", int)}


def apply(doc: dict[str, Any], img2img: bool) -> dict[str, Any]:
    """`doc` with the fields its `infotext` names filled in where the body left them out, as
    the webui does; values that do not convert are a 422 (the model validates the rest)."""
    from onecard import Error
    text = doc.get("infotext")
    if not isinstance(text, str) or not text.strip():
        return doc
    params = parse(text)
    out = dict(doc)
    for label, (name, kind) in _FIELDS.items():
        if name in doc or label not in params or (name == "mask_blur" and not img2img):
            continue
        value = params[label]
        if label == "Schedule type" and str(value).lower() == "automatic":
            continue
        try:
            out[name] = kind(value) if kind is not int else int(str(value).strip())
        except (TypeError, ValueError):
            raise Error(422, "invalid_parameter", f"infotext: {label}: {str(value)[:40]!r} is not a "
                                                     f"{'whole number' if kind is int else 'number'}") from None
    return out


# ---- pictures ---------------------------------------------------------------------------
def exif_with_infotext(text: str, max_bytes: int = 60_000) -> bytes:
    """EXIF holding `text` as the UserComment, as the webui writes it for JPEG and WebP. A
    JPEG segment holds at most 64 KiB: a longer text is cut to fit (the webui fails there)."""
    comment = text.encode("utf-16-be", "replace")[: max_bytes // 2 * 2]
    exif = Image.Exif()
    exif.get_ifd(EXIF_IFD)[USER_COMMENT] = UNICODE_PREFIX + comment
    return exif.tobytes()


def _user_comment(raw: bytes) -> str:
    exif = Image.Exif()
    try:
        exif.load(raw)
        value = exif.get_ifd(EXIF_IFD).get(USER_COMMENT, b"")
    except Exception:  # noqa: BLE001 - a broken EXIF block holds no infotext
        return ""
    if isinstance(value, str):
        return value
    if value.startswith(UNICODE_PREFIX):
        body = value[len(UNICODE_PREFIX):]
        # big-endian as the webui writes it; a little-endian writer shows as NULs in odd places
        codec = "utf-16-le" if body[1:2] == b"\x00" and body[:1] != b"\x00" else "utf-16-be"
        return body.decode(codec, "replace")
    if value[:8] in (b"ASCII\x00\x00\x00", b"\x00" * 8):
        value = value[8:]
    return value.decode("utf-8", "replace").rstrip("\x00")


def _png_chunks(data: bytes):
    """(position, kind, length) of each chunk after the signature, read by its length only."""
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        yield pos, kind, length
        pos += 12 + length


def png_chunks_within(data: bytes, limit: int) -> bool:
    """False when a PNG has more than `limit` chunks before its first IDAT: Pillow reads them
    one by one in Python when it opens the file, so their count is the cost."""
    for count, (_pos, kind, _length) in enumerate(_png_chunks(data), 1):
        if kind in (b"IDAT", b"IEND"):
            return True
        if count > limit:
            return False
    return True


# what Pillow inflates when it reads a PNG: text up to 64 MB in all (then it raises), ICC
# profiles up to 1 MB each with no total
COMPRESSED_CHUNKS = (b"zTXt", b"iTXt", b"iCCP")


def png_without_chunks(data: bytes, kinds: tuple[bytes, ...] = COMPRESSED_CHUNKS) -> bytes:
    """A PNG without its chunks of `kinds` (by default what Pillow inflates: for a reader of
    its pixels only); other pictures as they are."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return data
    view, pieces, kept = memoryview(data), [], 0
    for pos, kind, length in _png_chunks(data):
        if kind in kinds:
            pieces.append(view[kept:pos])
            kept = min(len(data), pos + 12 + length)
        if kind == b"IEND":
            break
    return data if not pieces else b"".join([*pieces, view[kept:]])


def read_info(im: Image.Image, max_chars: int) -> tuple[str, dict[str, Any]]:
    """(the infotext, the picture's other info items) as the webui's read_info_from_image finds
    them, without decoding a pixel. Items are kept when JSON can carry them (text, numbers),
    each text and their sum cut to `max_chars`."""
    items = dict(im.info or {})
    text = items.pop("parameters", None)
    raw_exif = items.pop("exif", None)
    if isinstance(raw_exif, bytes):
        comment = _user_comment(raw_exif)
        if comment:
            text = comment
    elif "comment" in items and text is None:
        comment = items["comment"]
        text = comment.decode("utf-8", "replace") if isinstance(comment, bytes) else str(comment)
    out: dict[str, Any] = {}
    budget = max_chars
    for key, value in items.items():
        if not isinstance(key, str) or key in _IGNORED_INFO_KEYS:
            continue
        if isinstance(value, bytes):
            continue
        if isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value):
            value = list(value)
        elif isinstance(value, str):
            value = value[:budget]
        elif not isinstance(value, (int, float, bool)):
            continue
        budget -= len(value) if isinstance(value, str) else 8
        if budget < 0:
            break
        out[key] = value
    text = text if isinstance(text, str) else ""
    return text[:max_chars], out


def open_metadata(data: bytes, formats: tuple[str, ...]) -> Image.Image:
    """A picture opened for its header and metadata only (no pixel is decoded); a PNG without
    its ICC profiles, which no reader of its metadata is given (icc_profile is ignored) and
    which Pillow inflates, up to 1 MB each with no total (500 in a 0.5 MB file: 1 s of CPU)."""
    return Image.open(io.BytesIO(png_without_chunks(data, (b"iCCP",))), formats=formats)


def encode_picture(img: Image.Image, fmt: str, quality: int, text: str | None) -> str:
    """Base64 of the picture as the webui sends it, with the infotext: a PNG's `parameters`
    text, a JPEG's or WebP's EXIF UserComment. Every format goes through the runtime's
    encoder: faster for PNG, and the big pictures do not hold the GIL there (Pillow's JPEG
    encoder held it 174 ms for a 40 MP extras answer, its WebP encoder 80 ms)."""
    import onecard
    if text is not None:
        text = text.encode("utf-8", "replace").decode()  # whatever a caller put there, a text chunk holds it
    if fmt == "png":
        return encode_png(img, {"parameters": text} if text else {})
    exif = exif_with_infotext(text) if text else None
    return onecard.encode_image_base64(img, "webp" if fmt == "webp" else "jpeg", quality, exif=exif)


def encode_png(img: Image.Image, texts: dict[str, str]) -> str:
    """Base64 of a PNG with text chunks, from the runtime's encoder (2x faster than Pillow's
    adaptive filtering); texts that are not Unicode are made so."""
    import onecard
    texts = {key: value.encode("utf-8", "replace").decode() for key, value in texts.items()}
    return onecard.encode_image_base64(img, "png", texts=texts)
