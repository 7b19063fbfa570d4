"""A short replay of the hostile-client attacks (bench/attack_soak.py is the long one): one real
unit of configs/default.toml in a real 4 GiB memory cgroup (a small pod: budgets follow the
limit), one representative of each attack class at a small size, from one client without
credentials. Each test asserts what the unit must do (no 5xx, the right 4xx, nothing held
for nothing), never how fast; the last one asserts that the unit survived all of it: still
running and ready, no OOM kill, every service's memory back near where it started.

Classes that the unit still fails are marked xfail(strict=True) with the root cause: the
replay stays in the suite, and a fix shows up as an XPASS that fails the run until its
marker is removed. Skipped (with the reason) where no memory cgroup can be made.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import socket
import threading
import time
import tomllib

import httpx
import numpy as np
import psutil
import pytest

from tests import images as I
from tests.harness import ROOT, SupervisorRun, free_port
from tests.memory_cgroup import memory_cgroup
from tests.webp_bombs import vp8l_bomb

GIB, MIB = 2**30, 2**20
LIMIT = 4 * GIB
WEBUI = "/sdapi/v1/img2img"


# ---- the unit ---------------------------------------------------------------------------------
class Unit:
    def __init__(self, run: SupervisorRun, group, ports: dict[str, int]):
        self.run, self.group, self.ports = run, group, ports
        self.pids = {s["name"]: s["pid"] for s in run.status_doc()["services"]}
        self.rss0 = {n: rss(p) for n, p in self.pids.items()}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def log_size(self) -> int:
        return self.run.log_path.stat().st_size

    def budget(self, name: str) -> int:
        """The host memory budget the supervisor planned for a service (its environment)."""
        env = open(f"/proc/{self.pids[name]}/environ", "rb").read().split(b"\0")
        return int(next(v for v in env if v.startswith(b"ONECARD_MEMORY_BUDGET_BYTES=")).split(b"=", 1)[1])


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@pytest.fixture(scope="module")
def unit(tmp_path_factory):
    cfg = tomllib.loads((ROOT / "configs" / "default.toml").read_text())
    ports = {name: free_port() for name in cfg["services"]}
    services = {name: {**svc, "port": ports[name]} for name, svc in cfg["services"].items()}
    sup = {**cfg["supervisor"], "health_port": free_port(), "health_host": "127.0.0.1"}
    with memory_cgroup(LIMIT) as group:
        with SupervisorRun(tmp_path_factory.mktemp("attack"), services, prefix=group.prefix(),
                           gpu=cfg.get("gpu"), **sup) as run:
            run.wait_ready(timeout=240)
            yield Unit(run, group, ports)


# ---- hostile clients -------------------------------------------------------------------------------
def raw(port: int, data: bytes, timeout: float = 120.0) -> tuple[int | None, bytes]:
    """Send these exact bytes on a fresh connection; the status and body that come back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:  # refused mid-send: its answer may be waiting
            pass
        got = b""
        while True:
            try:
                chunk = s.recv(1 << 20)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
            head, sep, body = got.partition(b"\r\n\r\n")
            length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(
                b"content-length:")), None)
            if sep and length is not None and len(body) >= length:
                break
    head, _, body = got.partition(b"\r\n\r\n")
    return (int(head[9:12]) if head.startswith(b"HTTP/1.") else None), body


def post(port: int, path: str, body: bytes, ctype: str, extra: str = "") -> tuple[int | None, bytes]:
    return raw(port, (f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {ctype}\r\n"
                      f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body)


def code(body: bytes) -> str | None:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return err.get("code") if isinstance(err, dict) else err


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Holders:
    """Connections that send `payload` (perhaps nothing), then never read."""

    def __init__(self, port: int, payload: bytes, n: int):
        self.socks = []
        for _ in range(n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            if payload:
                s.sendall(payload)
            self.socks.append(s)

    def close(self) -> None:
        for s in self.socks:
            s.close()


class PeakRss(threading.Thread):
    """A process's RSS, sampled every 20 ms until stopped; `peak` is the highest seen."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self._stop_ev = pid, rss(pid), threading.Event()

    def run(self) -> None:
        while not self._stop_ev.wait(0.02):
            self.peak = max(self.peak, rss(self.pid))

    def __enter__(self) -> PeakRss:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_ev.set()
        self.join()


def reset_hwm(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def hwm(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


# ---- the classes ---------------------------------------------------------------------------
def test_counts_and_products_are_refused_before_anything_is_decoded(unit):
    port = unit.ports["img2img"]
    bomb = b64(I.flat_png(6324, 6324))
    for count, batch in ((64, 1), (8, 4)):  # more pictures than batch_size: refused from the count alone
        s, body = post(port, WEBUI, json.dumps({"init_images": [bomb] * count, "batch_size": batch, "steps": 2})
                       .encode(), "application/json")
        assert (s, code(body)) == (422, "invalid_parameter"), (count, batch, body[:300])
    s, body = post(port, WEBUI, json.dumps({"init_images": [bomb], "batch_size": 16, "width": 6320, "height": 6320,
                                            "denoising_strength": 0}).encode(), "application/json")
    assert (s, code(body)) == (413, "too_costly"), body[:300]
    s, body = post(port, WEBUI, json.dumps({"init_images": [b64(I.small_png())], "steps": 2}).encode(),
                   "application/json")
    assert s == 200, body[:300]  # the next ordinary request is served


def test_a_request_refused_for_its_cost_decodes_no_picture(unit):
    pid = unit.pids["img2img"]
    bomb = b64(I.flat_png(6324, 6324))
    reset_hwm(pid)
    before = rss(pid)
    s, body = post(unit.ports["img2img"], WEBUI, json.dumps({"init_images": [bomb] * 8, "batch_size": 8,
                                                             "denoising_strength": 0.5}).encode(), "application/json")
    # twice what one request may hold (936 of 469 MiB), so the verdict does not hang on the
    # model's measured memory per pixel (4 pictures were just under it once the arena went)
    assert (s, code(body)) == (413, "too_costly"), body[:300]
    assert hwm(pid) - before < 64 * MIB  # headers only: one 6324x6324 decode alone is 120 MB


def test_an_answer_is_charged_its_encoder_by_the_format_asked(unit):
    """libwebp held 31.8 bytes a pixel to write noise at quality 100 (tests/unit/
    test_encoder_charges.py) where 3 were charged: four 16 MP WebP answers at once were 2 GB
    no budget knew of. The same picture is cheap enough as a JPEG answer."""
    port, picture, dry = unit.ports["img2img"], I.flat_png(4000, 4000), "X-Onecard-Dry-Run: 1\r\n"
    s, body = post(port, "/api/v1/img2img?format=webp&quality=100", picture, "image/png", dry)
    assert (s, code(body)) == (413, "too_costly") and b"webp" in body, body[:400]
    s, body = post(port, "/api/v1/img2img?format=jpeg", picture, "image/png", dry)
    assert s == 200 and json.loads(body)["valid"], body[:400]


def test_the_options_store_is_bounded(unit):
    port = unit.ports["img2img"]
    s, body = post(port, "/sdapi/v1/options", json.dumps({"attack_big": "x" * 100_000}).encode(), "application/json")
    assert (s, code(body)) == (413, "option_too_large"), body[:300]
    codes = [post(port, "/sdapi/v1/options", json.dumps({f"attack_{i}_{k}": "x" * 60_000 for k in range(16)})
                  .encode(), "application/json")[0] for i in range(3)]
    assert codes[0] == 200 and codes[1:] == [413, 413], codes
    r = httpx.get(unit.url("img2img") + "/sdapi/v1/options", timeout=30)
    assert r.status_code == 200 and len(r.content) <= 2**20 + 4096


def test_polls_of_a_big_result_hold_one_encoded_copy(unit):
    jobs = unit.url("jobs")
    picture = I.noisy_png(1600, 1600, 1.0)  # incompressible: the result is about as big
    r = httpx.post(jobs + "/v1/jobs", json={"service": "img2img", "route": "/api/v1/img2img",
                                            "params": {"style": 3, "format": "png"}, "image": b64(picture)}, timeout=60)
    assert r.status_code == 202, r.text[:300]
    job = r.json()["id"]
    doc = httpx.get(f"{jobs}/v1/jobs/{job}?wait=10", timeout=60)
    for _ in range(10):
        if doc.json()["state"] == "succeeded":
            break
        doc = httpx.get(f"{jobs}/v1/jobs/{job}?wait=10", timeout=60)
    assert doc.json()["state"] == "succeeded", doc.text[:300]
    answer = len(doc.content)
    pid = unit.pids["jobs"]
    base = rss(pid)
    with PeakRss(pid) as peak:
        holders = Holders(unit.ports["jobs"], f"GET /v1/jobs/{job} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), 24)
        time.sleep(3)
        holders.close()
    assert peak.peak - base < 6 * answer, (peak.peak - base, answer)  # 24 copies now


def test_big_submits_are_admitted_against_the_jobs_budget_before_their_bodies(unit):
    body = b'{"service": "detect", "route": "/api/v1/facedetect", "image": "' + b"A" * 29_999_900 + b'"}'
    pid, budget = unit.pids["jobs"], unit.budget("jobs")
    with PeakRss(pid) as peak, concurrent.futures.ThreadPoolExecutor(40) as pool:
        statuses = list(pool.map(lambda i: post(unit.ports["jobs"], "/v1/jobs", body, "application/json")[0],
                                 range(40)))
    assert all(s in (413, 503) for s in statuses), statuses
    assert peak.peak <= budget, (peak.peak // MIB, budget // MIB)


def test_probe_port_answers_whatever_idle_clients_hold(unit):
    port = unit.run.health_port
    for _ in range(2):  # idle holders, reopened as the attacker did
        holders = Holders(port, b"", 70)
        try:
            for path in ("/healthz", "/readyz"):
                s, body = raw(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), timeout=10)
                assert s == 200, body[:200]
        finally:
            holders.close()


def test_decoders_without_a_bound_are_refused_or_bounded(unit):
    """Pictures whose decode costs more than their size says: refused from their structure, or
    decoded within the cost model (a 40 MP picture: 200, or 413 where the budget is too small)."""
    paths = {"detect": "/api/v1/facedetect", "img2img": "/api/v1/img2img?style=3&format=jpeg"}
    cases = [("1.58 M empty PNG chunks", I.png_chunk_bomb(), "image/png", {"detect": {413}, "img2img": {413}}),
             ("20 MB RLE8 BMP of 1x2", I.rle8_bmp_bomb(), "image/bmp", {"detect": {200}, "img2img": {422}}),
             ("RLE4 BMP 1500 px", I.rle4_bmp(1500, 1500), "image/bmp", {"detect": {200}}),
             ("animated WebP, 2000 frames", I.webp_animation((2000, 2000), 2000), "image/webp", {"detect": {200}}),
             ("40 MP WebP of one colour", I.flat_webp(6324, 6324), "image/webp", {"detect": {200, 413}}),
             ("40 MP JPEG of one colour", I.flat_jpeg(6324, 6324), "image/jpeg", {"detect": {200, 413}}),
             # 300 kB that libwebp decodes into 360 MiB of Huffman tables, charged what it may name
             ("lossless WebP naming 65 536 groups", vp8l_bomb(), "image/webp", {"detect": {413}})]
    for what, data, ctype, want in cases:
        for name, ok in want.items():
            s, body = post(unit.ports[name], paths[name], data, ctype)
            assert s in ok, (what, name, s, body[:200])
            if s == 413:
                assert code(body) in ("image_too_complex", "too_costly", "too_many_pixels"), (what, body[:200])


def test_an_endless_header_is_cut_at_once_on_every_port(unit):
    for port in [*unit.ports.values(), unit.run.health_port]:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: ")
            got = b""
            for _ in range(64):  # at most 1 MiB: the answer comes within one read past the limit
                try:
                    s.sendall(b"a" * 16384)
                except OSError:
                    break
            try:
                got = s.recv(4096)
            except OSError:
                pass
            assert got.startswith(b"HTTP/1.1 431"), (port, got[:100])


# ---- our own classes -----------------------------------------------------------------------------------
def test_json_of_millions_of_empty_containers_is_refused_before_parsing(unit):
    body = I.tiny_containers_json(3_000_000)
    for name, path in (("detect", "/api/v1/facedetect"), ("img2img", WEBUI), ("jobs", "/v1/jobs")):
        s, got = post(unit.ports[name], path, body, "application/json")
        assert s == 413, (name, s, got[:200])


def test_numbers_at_the_edges_are_4xx(unit):
    png = b64(I.small_png())
    for raw_number in ("9" * 5000, "1e308", "1e-400", "1.5"):
        for name, path, doc in (
                ("detect", "/api/v1/facedetect", f'{{"image": "{png}", "max_faces": {raw_number}}}'),
                ("img2img", WEBUI, f'{{"init_images": ["{png}"], "n_iter": {raw_number}}}'),
                ("jobs", "/v1/jobs", f'{{"service": "detect", "route": "/api/v1/facedetect", "image": "{png}", '
                                     f'"params": {{"max_faces": {raw_number}}}}}')):
            s, body = post(unit.ports[name], path, doc.encode(), "application/json")
            assert s in (400, 422), (name, raw_number[:10], s, body[:200])


def test_slow_uploads_do_not_lock_out_other_clients(unit):
    head = (b"POST /api/v1/img2img?style=3 HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            b"Content-Length: 20000000\r\n\r\n")
    socks = []
    try:
        for _ in range(120):
            s = socket.create_connection(("127.0.0.1", unit.ports["img2img"]), timeout=10)
            s.sendall(head + b"\0" * 4096)
            socks.append(s)
        time.sleep(1)
        s, body = post(unit.ports["img2img"], "/api/v1/img2img?style=3", I.small_png(), "image/png")
        assert s == 200, body[:300]
    finally:
        for sock in socks:
            sock.close()


def test_idle_connections_do_not_take_the_public_healthz_away(unit):
    holders = Holders(unit.ports["detect"], b"", 600)
    try:
        s, body = raw(unit.ports["detect"], b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", timeout=10)
        assert s == 200, (s, body[:200])
    finally:
        holders.close()


def test_a_body_in_one_byte_chunks_is_cut(unit):
    head = (b"POST /api/v1/facedetect HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    s, body = raw(unit.ports["detect"], head + b"1\r\nA\r\n" * 7_500_000)  # 45 MB on the wire
    assert s == 413, body[:200]


def test_an_exif_bomb_writes_no_log_flood(unit):
    before = unit.log_size()
    s, body = post(unit.ports["detect"], "/api/v1/facedetect", I.exif_bomb_png(60_000), "image/png")
    assert s == 200, body[:200]
    time.sleep(1)  # the supervisor copies the service's output to its log
    assert unit.log_size() - before < 64 * 1024


def test_pictures_a_c_library_complains_about_write_no_log_flood(unit):
    """libpng prints a line to detect's stderr for each PNG whose checksum fails: 200 of them
    leave that line once in the unit's log, with how many times it repeated."""
    bad = I.bad_crc_png(64, 64, color_type=2)
    before = unit.log_size()
    answers = [post(unit.ports["detect"], "/api/v1/facedetect", bad, "image/png")[0] for _ in range(200)]
    assert set(answers) <= {200, 400}, answers
    time.sleep(1)
    assert unit.log_size() - before < 4096


# ---- and the unit is still there ----------------------------------------------------------------------
def test_zz_the_unit_survived_every_attack(unit):
    assert unit.run.proc.poll() is None, unit.run.output()[-3000:]
    assert unit.group.oom_kills() == 0
    assert {s["name"]: s["pid"] for s in unit.run.status_doc()["services"]} == unit.pids  # nobody restarted
    s, body = raw(unit.run.health_port, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", timeout=30)
    assert s == 200, body[:300]
    deadline = time.monotonic() + 30
    while True:  # memory back near its start once the attackers are gone
        over = {n: (rss(p) - unit.rss0[n]) // MIB for n, p in unit.pids.items()
                if rss(p) - unit.rss0[n] > max(128 * MIB, unit.rss0[n] // 4)}
        if not over or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not over, f"RSS still above its start (MiB): {over}"


def test_zz_idle_memory_comes_back_after_big_calls(unit):
    from PIL import Image
    photo = I.encode(np.asarray(Image.fromarray(I.astronaut()).resize((1024, 1024))), "JPEG", quality=90)
    pid = unit.pids["img2img"]
    assert post(unit.ports["img2img"], "/api/v1/img2img?style=3", I.small_png(), "image/png")[0] == 200
    start = rss(pid)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: post(unit.ports["img2img"], "/api/v1/img2img?style=3&format=jpeg",
                                               photo, "image/jpeg"), range(4)))
    assert [s for s, _ in answers] == [200] * 4, [body[:300] for s, body in answers if s != 200]
    deadline = time.monotonic() + 10
    while rss(pid) - start > 64 * MIB and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rss(pid) - start <= 64 * MIB, (rss(pid) - start) // MIB
