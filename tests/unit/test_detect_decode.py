"""CenterFace's decoding on its own (no model): what a heatmap may cost."""

from __future__ import annotations

import json

import numpy as np

from services.detect.app import _map_back
from services.detect.backends import MAX_CANDIDATES, MAX_FACES, CenterFaceBackend, DetectItem, _limit, answer_bytes
from services.detect.settings import DetectSettings


def _outputs(heat: np.ndarray):
    n = heat.shape[0]
    return (heat, np.zeros((2, n, n), np.float32), np.zeros((2, n, n), np.float32),
            np.zeros((10, n, n), np.float32))


def test_min_score_zero_keeps_only_the_best_cells_as_candidates():
    """min_score 0 makes every heatmap cell a candidate (25 600 on a 640 canvas): only the
    MAX_CANDIDATES best go on to NMS and into the answer, the best of them first."""
    backend = CenterFaceBackend(DetectSettings())
    rng = np.random.default_rng(0)
    heat = rng.uniform(0.01, 0.5, (160, 160)).astype(np.float32)
    heat[80, 80] = 0.99
    item = DetectItem(np.zeros((640, 640, 3), np.uint8), 0.0, None)
    faces = backend._decode(*_outputs(heat), 1.0, item)
    assert 0 < len(faces) <= MAX_CANDIDATES
    assert faces[0]["score"] == 0.99


def test_a_photos_few_candidates_are_all_kept():
    backend = CenterFaceBackend(DetectSettings())
    heat = np.zeros((160, 160), np.float32)
    heat[20, 20], heat[100, 60] = 0.9, 0.8
    item = DetectItem(np.zeros((640, 640, 3), np.uint8), 0.5, None)
    faces = backend._decode(*_outputs(heat), 1.0, item)
    assert [f["score"] for f in faces] == [0.9, 0.8]


def test_an_answer_holds_max_faces_at_most_and_weighs_what_answer_bytes_says():
    """What a job reserves for a detect result (the dry run's output_bytes) is a bound: the
    answer carries MAX_FACES faces at most, each no longer than its share, at the widest
    numbers a face may hold (far outside a huge picture, unrounded scores)."""
    wide = -1.2345678901234567e-300
    faces = [{"box": [wide] * 4, "score": 1 / 3 - i * 1e-9, "landmarks": [[wide, wide]] * 5}
             for i in range(MAX_FACES + 500)]
    kept = _limit(list(faces), None)
    assert len(kept) == MAX_FACES and len(_limit(list(faces), 10_000)) == MAX_FACES
    assert len(_limit(list(faces), 3)) == 3
    answer = {"faces": [_map_back(f, 1.0, 50_000, 50_000) for f in kept], "width": 50_000, "height": 50_000}
    assert len(json.dumps(answer)) <= answer_bytes(None)
    assert len(json.dumps({**answer, "faces": answer["faces"][:3]})) <= answer_bytes(3) < answer_bytes(None)
