"""Pillow pictures as numpy arrays without one long hold of the GIL.

``np.asarray(image)`` asks Pillow for ``image.tobytes()``: the pixels unpacked in 64 KiB
pieces, then joined into one bytes object with the GIL held all along the copy: 82 ms for
a 40 MP answer (an extras upscale), which the event loop and its probes waited. Here the
rows go a slice at a time into an array made beforehand, each slice in the GIL lane."""

from __future__ import annotations

import numpy as np
from PIL import Image

from services.runtime.codecs.gil_lane import in_lane

SLICE_BYTES = 1 << 20
_BANDS = {"L": 1, "RGB": 3, "RGBA": 4}


def array_of(img: Image.Image) -> np.ndarray:
    """The pixels of an L, RGB or RGBA picture as a new uint8 array (height x width [x bands]),
    as np.asarray gives them; other modes through np.asarray itself."""
    bands = _BANDS.get(img.mode)
    row = img.width * (bands or 0)
    if bands is None or row * img.height <= SLICE_BYTES:
        return np.asarray(img)
    out = np.empty((img.height, img.width, bands) if bands > 1 else (img.height, img.width), np.uint8)
    rows = max(1, SLICE_BYTES // row)
    for top in range(0, img.height, rows):
        in_lane(SLICE_BYTES, _rows_into, img, out, top, min(img.height, top + rows))
    return out


def _rows_into(img: Image.Image, out: np.ndarray, top: int, bottom: int) -> None:
    out[top:bottom] = np.asarray(img.crop((0, top, img.width, bottom)))
