"""jpeg.next_marker finds the same marker as the regex it stands in for over long spans, where
it searches with numpy (the GIL left free), across its window boundaries too."""

from __future__ import annotations

import numpy as np
import pytest

from services.runtime.codecs import jpeg


def _regex(data: bytes, pos: int) -> int:
    m = jpeg._NEXT_MARKER.search(data, pos)
    return -1 if m is None else m.start()


@pytest.mark.parametrize("seed", range(6))
def test_the_numpy_search_finds_what_the_regex_finds(monkeypatch, seed):
    monkeypatch.setattr(jpeg, "NUMPY_MIN_BYTES", 0)
    monkeypatch.setattr(jpeg, "WINDOW_BYTES", 97)  # many window boundaries
    rng = np.random.default_rng(seed)
    # entropy-coded data: stuffed 0xFF00, restart markers, fill bytes, and now and then a marker
    pool = np.array([0xFF, 0x00, 0xD0, 0xD7, 0xD8, 0xD9, 0xDA, 0x12, 0xFF, 0x00], np.uint8)
    data = bytes(rng.choice(pool, 5000, p=[0.3, 0.3, 0.1, 0.1, 0.004, 0.003, 0.003, 0.09, 0.05, 0.05]))
    for pos in [0, 1, 96, 97, 98, *rng.integers(0, len(data), 40).tolist(), len(data) - 2, len(data) - 1]:
        assert jpeg.next_marker(data, pos) == _regex(data, pos), pos
    stuffed = b"\xff\x00" * 3000 + b"\xff\xd3\xff\xff\xff"
    assert jpeg.next_marker(stuffed, 0) == _regex(stuffed, 0) == -1
    assert jpeg.next_marker(stuffed + b"\xd9", 0) == _regex(stuffed + b"\xd9", 0) == len(stuffed) - 1


def test_a_real_photos_scan_is_walked_the_same_with_either_search(monkeypatch):
    import cv2
    photo = cv2.imencode(".jpg", np.random.default_rng(1).integers(0, 255, (900, 1200, 3), dtype=np.uint8),
                         [cv2.IMWRITE_JPEG_QUALITY, 97])[1].tobytes()
    assert len(photo) > jpeg.NUMPY_MIN_BYTES
    with_numpy = jpeg.walk(photo, 32, 512)
    monkeypatch.setattr(jpeg, "NUMPY_MIN_BYTES", 1 << 40)
    assert jpeg.walk(photo, 32, 512) == with_numpy and with_numpy.scans == 1
