"""JSON bodies are counted before they are parsed: a document of many tiny containers (3 bytes
of `[]` become 56 bytes of list, and json.loads holds the GIL for all of it) is refused with
413 json_too_complex on every route that reads JSON, model routes and plain routes alike,
in a real service written with the public API. Other bodies are not counted."""

from __future__ import annotations

import json

import pytest

from onecard.testing import ServiceProcess
from tests.harness import ROOT

APP = "tests.children.sdk_app:create_app"
MAX_ITEMS = 64


@pytest.fixture(scope="module")
def svc():
    with ServiceProcess(APP, {"max_json_items": MAX_ITEMS, "max_batch_size": 1, "cpu_workers": 2},
                        pythonpath=[ROOT]) as s:
        yield s


def post_json(svc, path: str, body: bytes):
    return svc.client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", ["/api/v1/words", "/notes"])
def test_json_of_many_tiny_containers_is_413_before_parsing(svc, path):
    body = json.dumps({"text": "two words", "pad": [[] for _ in range(MAX_ITEMS)]}).encode()
    r = post_json(svc, path, body)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "json_too_complex"
    assert r.headers.get("connection") == "close"  # refused as it arrived: the connection ends with it


@pytest.mark.parametrize("path", ["/api/v1/words", "/notes"])
def test_json_within_the_items_limit_is_served(svc, path):
    body = json.dumps({"text": "two words", "pad": [[] for _ in range(MAX_ITEMS // 4)]}).encode()
    r = post_json(svc, path, body)
    assert r.status_code == 200, r.text


def test_a_big_document_of_empty_lists_is_refused_without_being_read_whole(svc):
    """3 MB of `[]`, chunked in 64 KiB pieces: refused at the first piece, the service stays
    responsive, and the next request on a new connection is served."""
    piece = b"[" + b"[]," * 21_000 + b"[]]"

    def chunks():
        for _ in range(48):
            yield piece

    r = svc.client.post("/api/v1/words", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "json_too_complex", r.text
    assert svc.client.get("/healthz").status_code == 200
    assert post_json(svc, "/api/v1/words", b'{"text": "still here"}').status_code == 200


def test_only_json_bodies_are_counted(svc):
    text = ", ".join(["word"] * (MAX_ITEMS * 4))  # far more commas than items allowed
    r = svc.client.post("/api/v1/words", content=text.encode(), headers={"content-type": "text/plain"})
    assert r.status_code == 200, r.text


def test_a_document_nested_deeper_than_the_depth_limit_is_400_however_deep(svc):
    for depth in (40, 40_000):  # under and over the item count: one answer for one class of body
        body = b'{"text": "x", "pad": ' + b"[" * depth + b"]" * depth + b"}"
        r = post_json(svc, "/api/v1/words", body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep", (depth, r.text)
