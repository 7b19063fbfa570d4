"""HTTP Basic auth as the webui's --api-auth does it, through the real clients' own
ways of sending credentials (webuiapi's set_auth, sd-backend-client's credentials
provider), alongside the API key; and polls and listings not counted as served work."""

from __future__ import annotations

import re

import httpx
import pytest
import webuiapi
from sd_backend_client.api.a1111_webservice import A1111Webservice
from sd_backend_client.errors import AuthError

from tests.service_harness import ServiceProcess
from tests.webui_helpers import APP, picture, style_settings

PAIRS = "alice:s3cret-Pa55,bob:other-pw"
API_KEY = "k-0123456789abcdef"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    # these tests send many wrong credentials on purpose; the failure limiter has its own tests
    settings = {**style_settings(), "basic_auth_env": "ONECARD_TEST_WEBUI_AUTH", "api_key": API_KEY,
                "auth_max_failures": 1000}
    with ServiceProcess(APP, settings, tmp_path_factory.mktemp("auth"),
                        env={"ONECARD_TEST_WEBUI_AUTH": PAIRS, "ONECARD_ACCESS_LOG": "1"}) as service:
        yield service


def test_webuiapi_set_auth(guarded):
    api = webuiapi.WebUIApi(baseurl=guarded.url + "/sdapi/v1")
    assert api.session.get(api.baseurl + "/sd-models").status_code == 401
    with pytest.raises(RuntimeError) as err:
        api.img2img(images=[picture(64, 64)], width=64, height=64)
    assert err.value.args[0] == 401
    api.set_auth("alice", "wrong")
    assert api.session.get(api.baseurl + "/options").status_code == 401
    api.set_auth("alice", "s3cret-Pa55")
    title = api.util_get_current_model()
    assert title.startswith("multistyle26 [")
    r = api.img2img(images=[picture(64, 64)], width=64, height=64, seed=3)
    assert len(r.images) == 1 and r.info["all_seeds"] == [3]
    bob = webuiapi.WebUIApi(baseurl=guarded.url + "/sdapi/v1", username="bob", password="other-pw")
    assert bob.util_get_model_names() == [title]
    keyed = httpx.get(guarded.url + "/sdapi/v1/options", headers={"Authorization": f"Bearer {API_KEY}"})
    assert keyed.status_code == 200  # the API key still works alongside
    assert httpx.get(guarded.url + "/internal/ping").json() == {}  # webui leaves it open too
    assert api.get_cmd_flags()["api_auth"] == "***"


def test_sd_backend_client_credentials_provider(guarded):
    asked = []

    def provider():
        asked.append(1)
        return ("bob", "other-pw")
    ws = A1111Webservice(guarded.url, credentials_provider=provider)
    assert ws.get_config()["sd_model_checkpoint"].startswith("multistyle26 [")
    assert asked == [1]  # asked once, on the first 401
    res = ws.img2img(picture(64, 64))
    assert len(res["images"]) == 1
    with pytest.raises(AuthError):
        A1111Webservice(guarded.url, credentials_provider=lambda: ("bob", "nope")).get_config()


def test_openapi_says_basic_and_key_and_no_password_is_printed(guarded):
    doc = httpx.get(guarded.url + "/openapi.json").json()
    assert doc["components"]["securitySchemes"]["basic"] == {"type": "http", "scheme": "basic"}
    assert {"basic", "apiKey", "bearer"} <= {name for entry in doc["security"] for name in entry}
    r = httpx.get(guarded.url + "/sdapi/v1/progress")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    log = guarded.output()
    assert "GET /sdapi/v1/progress 401" in log  # the access log ran
    for secret in ("s3cret-Pa55", "other-pw", API_KEY):
        assert secret not in log
        assert secret not in httpx.get(guarded.url + "/sdapi/v1/cmd-flags", auth=("bob", "other-pw")).text
        assert secret not in httpx.get(guarded.url + "/sdapi/v1/options", auth=("bob", "other-pw")).text


def test_polls_and_listings_are_not_served_model_requests(guarded):
    api = webuiapi.WebUIApi(baseurl=guarded.url + "/sdapi/v1", username="alice", password="s3cret-Pa55")
    before = httpx.get(guarded.url + "/stats").json()
    for _ in range(10):
        api.get_progress()
        api.get_sd_models()
        api.get_options()
        api.get_samplers()
    assert httpx.get(guarded.url + "/stats").json()["served"] == before["served"]
    api.img2img(images=[picture(64, 64)], width=64, height=64)
    after = httpx.get(guarded.url + "/stats").json()
    assert after["served"] == before["served"] + 1
    metrics = httpx.get(guarded.url + "/metrics").text
    assert re.search(r'onecard_requests_total\{route="/sdapi/v1/progress",status="200"\} (\d+)', metrics)
    staged = set(re.findall(r'onecard_stage_seconds_count\{route="([^"]+)"', metrics))
    assert "/sdapi/v1/img2img" in staged and "/sdapi/v1/progress" not in staged


def test_401_on_sdapi_routes_is_in_the_webui_shape(guarded):
    """The webui answers a refused credential {"detail": ...}; our /sdapi routes (model routes,
    control routes, listings, unknown paths) answer its shape, with the challenge."""
    for method, path, body in (("GET", "/sdapi/v1/options", None), ("POST", "/sdapi/v1/img2img", {"init_images": []}),
                               ("POST", "/sdapi/v1/png-info", {"image": ""}), ("GET", "/sdapi/v1/sd-models", None),
                               ("POST", "/sdapi/v1/extra-single-image", {}), ("GET", "/sdapi/v1/no-such", None)):
        r = httpx.request(method, guarded.url + path, json=body, auth=("alice", "wrong"))
        assert r.status_code == 401, (path, r.text)
        doc = r.json()
        assert set(doc) == {"error", "detail", "body", "errors"} and doc["error"] == "unauthorized", doc
        assert "credentials" in doc["detail"] and doc["errors"] == f"401: {doc['detail']}"
        assert r.headers["www-authenticate"].startswith("Basic")
    r = httpx.post(guarded.url + "/api/v1/img2img", content=b"", auth=("alice", "wrong"))
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"  # other routes keep theirs
    doc = httpx.get(guarded.url + "/openapi.json").json()
    err = doc["paths"]["/sdapi/v1/options"]["get"]["responses"]["401"]["content"]["application/json"]["schema"]
    assert err["required"] == ["error", "detail", "body", "errors"]
