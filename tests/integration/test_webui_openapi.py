"""Every webui route describes what it answers, and answers what it describes: the
OpenAPI document is valid, each /sdapi operation documents its 200 body and its errors in
the webui's shape, and the live answers (listings, settings, generations, png-info,
extras, errors) validate against the documented schemas."""

from __future__ import annotations

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate as validate_spec

from tests.webui_helpers import b64, picture, webui_service

HTTP_METHODS = ("get", "post", "put", "patch", "delete")


@pytest.fixture(scope="module", params=["style", "diffusers"])
def svc(request, tmp_path_factory):
    for service in webui_service(request.param, tmp_path_factory):
        service.doc = httpx.get(service.url + "/openapi.json").json()
        yield service


def webui_operations(doc: dict):
    for path, ops in doc["paths"].items():
        if path.startswith("/sdapi/") or path == "/internal/ping":
            for method, op in ops.items():
                if method in HTTP_METHODS:
                    yield path, method, op


def schema_of(doc: dict, path: str, method: str, status: int) -> dict:
    return doc["paths"][path][method]["responses"][str(status)]["content"]["application/json"]["schema"]


def conforms(doc: dict, path: str, method: str, r: httpx.Response) -> None:
    schema = schema_of(doc, path, method, r.status_code)
    jsonschema.Draft202012Validator(schema).validate(r.json())


def test_the_document_is_valid_and_every_webui_route_documents_its_answers(svc):
    doc = svc.doc
    validate_spec(doc)  # OpenAPI 3.1, the whole document
    ops = list(webui_operations(doc))
    assert len(ops) >= 34, [f"{m} {p}" for p, m, _ in ops]
    for path, method, op in ops:
        ok = op["responses"].get("200", {}).get("content", {}).get("application/json", {}).get("schema")
        assert ok, f"{method.upper()} {path} has no 200 schema"
        jsonschema.Draft202012Validator.check_schema(ok)
        for status, response in op["responses"].items():
            # 408, 431 and 499 are the connection's (the runtime's protocol layer), before any route
            if status.startswith(("4", "5")) and status not in ("408", "431", "499") and path != "/internal/ping":
                err = response["content"]["application/json"]["schema"]
                assert err["required"] == ["error", "detail", "body", "errors"], (method, path, status)
    # the new routes are there, each a job route's kind (a JSON body) or a listing
    for path in ("/sdapi/v1/png-info", "/sdapi/v1/extra-single-image", "/sdapi/v1/extra-batch-images"):
        assert doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert "requestBody" not in doc["paths"]["/sdapi/v1/options"]["post"]  # a control route, never a job


def test_every_webui_get_answers_its_documented_schema(svc):
    doc = svc.doc
    gets = [path for path, method, _ in webui_operations(doc) if method == "get"]
    for path in gets:
        r = httpx.get(svc.url + path, timeout=30)
        assert r.status_code == 200, (path, r.text)
        conforms(doc, path, "get", r)
    for path in ("/sdapi/v1/interrupt", "/sdapi/v1/skip", "/sdapi/v1/refresh-checkpoints",
                 "/sdapi/v1/reload-checkpoint"):
        r = httpx.post(svc.url + path, timeout=30)
        assert r.status_code == 200
        conforms(doc, path, "post", r)


def test_model_routes_and_errors_answer_their_documented_schemas(svc):
    doc = svc.doc
    src = b64(picture(64, 64))
    calls = [
        ("/sdapi/v1/img2img", {"init_images": [src], "width": 64, "height": 64, "steps": 2}),
        ("/sdapi/v1/png-info", {"image": src}),
        ("/sdapi/v1/extra-single-image", {"image": src, "upscaler_1": "Lanczos"}),
        ("/sdapi/v1/extra-batch-images", {"imageList": [{"data": src, "name": "a"}], "upscaler_1": "Nearest"}),
        ("/sdapi/v1/options", {"samples_format": "png"}),
        # errors of several kinds and statuses
        ("/sdapi/v1/img2img", {"init_images": [src], "denoising_strength": 7}),
        ("/sdapi/v1/img2img", {"init_images": ["#"], "width": 64, "height": 64}),
        ("/sdapi/v1/png-info", {"image": "R0lGODlh"}),
        ("/sdapi/v1/extra-single-image", {"image": b64(picture(512, 512)), "upscaling_resize": 16,
                                          "upscaler_1": "Lanczos"}),
        ("/sdapi/v1/options", {"jpeg_quality": "high"}),
    ]
    if svc.backend == "diffusers":
        calls += [("/sdapi/v1/txt2img", {"prompt": "x", "width": 64, "height": 64, "steps": 2}),
                  ("/sdapi/v1/img2img", {"init_images": [src], "sampler_name": "nope"})]
    else:
        calls += [("/sdapi/v1/txt2img", {"prompt": "x"})]
    seen = set()
    for path, body in calls:
        r = httpx.post(svc.url + path, json=body, timeout=60)
        seen.add(r.status_code)
        conforms(doc, path, "post", r)
    assert {200, 400, 413, 415, 422} <= seen
