"""The webui settings store (/sdapi/v1/options, and override_settings kept after a request):
known keys typed as the webui's settings page bounds them, the unit's own facts kept,
other keys bounded in count and size, the whole document bounded; 413 beyond, naming the
figure, and nothing stored by a refused or a dry-run request."""

from __future__ import annotations

import httpx
import pytest

from services.img2img.webui_options import OptionsStore
from tests.service_harness import ServiceProcess
from tests.webui_helpers import APP, assert_webui_error, b64, picture, style_settings

LIMITS = {"max_option_keys": 5, "max_option_value_bytes": 1024, "max_options_bytes": 4096}


@pytest.fixture
def svc(tmp_path):
    """A fresh service each: stored settings cannot be removed (as in the webui), so a test's
    keys would count against the next one's bounds."""
    with ServiceProcess(APP, {**style_settings(), **LIMITS}, tmp_path) as service:
        yield service


def options(svc) -> dict:
    r = httpx.get(svc.url + "/sdapi/v1/options", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


def set_options(svc, doc) -> httpx.Response:
    return httpx.post(svc.url + "/sdapi/v1/options", json=doc, timeout=30)


def unknown_keys(doc: dict) -> set[str]:
    return {k for k in doc if k.startswith("client_")}


def test_known_keys_are_typed(svc):
    before = options(svc)
    for doc, field in (({"jpeg_quality": "80"}, "jpeg_quality"), ({"jpeg_quality": 101}, "jpeg_quality"),
                       ({"jpeg_quality": 80.5}, "jpeg_quality"), ({"jpeg_quality": True}, "jpeg_quality"),
                       ({"samples_format": "gif"}, "samples_format"), ({"enable_pnginfo": "yes"}, "enable_pnginfo"),
                       ({"show_progress_every_n_steps": None}, "show_progress_every_n_steps"),
                       ({"inpainting_mask_weight": 2}, "inpainting_mask_weight"),
                       ({"onecard_style": "3:nan"}, "onecard_style"), ({"sd_vae": ["x"]}, "sd_vae"),
                       ({"sd_model_checkpoint": "another.safetensors"}, "sd_model_checkpoint")):
        assert_webui_error(set_options(svc, doc), 422, "invalid_parameter", field)
    assert options(svc) == before  # a refused document stores nothing, not even its valid keys
    try:
        assert set_options(svc, {"jpeg_quality": 55.0, "initial_noise_multiplier": 1}).status_code == 200
        after = options(svc)
        assert after["jpeg_quality"] == 55 and isinstance(after["jpeg_quality"], int)  # coerced as the webui reads it
        assert after["initial_noise_multiplier"] == 1.0 and isinstance(after["initial_noise_multiplier"], float)
    finally:
        set_options(svc, {"jpeg_quality": 80, "initial_noise_multiplier": 1.0})


def test_a_client_posting_the_whole_document_back_changes_nothing_it_may_not(svc):
    """Open WebUI reads the options, sets sd_model_checkpoint in them and posts them all back."""
    doc = options(svc)
    sent = {**doc, "sd_model_checkpoint": doc["sd_model_checkpoint"].split(" [")[0], "sd_checkpoint_hash": "0" * 64,
            "onecard_backend": "diffusers"}
    assert set_options(svc, sent).status_code == 200
    assert options(svc) == doc  # this unit's facts kept, the checkpoint's name normalised to its title


def test_unknown_keys_are_bounded_in_count_size_and_total(svc):
    for i in range(5):
        assert set_options(svc, {f"client_{i}": {"i": i}}).status_code == 200
    assert_webui_error(set_options(svc, {"client_5": 1}), 413, "too_many_options", "6", "5")
    assert set_options(svc, {"client_0": "replaced"}).status_code == 200  # a stored key can change
    assert unknown_keys(options(svc)) == {f"client_{i}" for i in range(5)}
    assert_webui_error(set_options(svc, {"client_1": "x" * 1100}), 413, "option_too_large", "client_1", "1024")
    assert set_options(svc, {f"client_{i}": "y" * 900 for i in range(3)}).status_code == 200
    more = {"client_3": "y" * 900, "client_4": "y" * 900, "jpeg_quality": 90}  # each within its limit,
    assert_webui_error(set_options(svc, more), 413, "options_too_large", "4096")  # the document over its own
    assert options(svc)["jpeg_quality"] == 80 and options(svc)["client_3"] == {"i": 3}  # all or nothing
    r = httpx.post(svc.url + "/sdapi/v1/options", content=b'{"client_0": "' + b"z" * 9000 + b'"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert_webui_error(r, 413, "body_too_large", "4096")
    r = httpx.post(svc.url + "/sdapi/v1/options", content=b"{}", headers={"content-type": "text/plain"})
    assert_webui_error(r, 415, "unsupported_media_type")


def test_override_settings_kept_after_a_request_are_bounded_alike(svc):
    src = b64(picture(64, 64))
    body = {"init_images": [src], "width": 64, "height": 64, "steps": 2, "override_settings_restore_afterwards": False}
    served = httpx.get(svc.url + "/stats").json()["served"]
    too_many = {f"client_o{i}": i for i in range(6)}
    r = httpx.post(svc.url + "/sdapi/v1/img2img", json={**body, "override_settings": too_many}, timeout=60)
    assert_webui_error(r, 413, "too_many_options", "override_settings.")
    r = httpx.post(svc.url + "/sdapi/v1/img2img", json={**body, "override_settings": {"client_big": "x" * 2000}},
                   timeout=60)
    assert_webui_error(r, 413, "option_too_large", "override_settings.client_big")
    assert httpx.get(svc.url + "/stats").json()["served"] == served  # refused before the model
    # not kept: any number, applied to this request only
    r = httpx.post(svc.url + "/sdapi/v1/img2img", timeout=60,
                   json={**body, "override_settings_restore_afterwards": True, "override_settings": too_many})
    assert r.status_code == 200 and unknown_keys(options(svc)) == set()
    # a dry run validates and stores nothing
    r = httpx.post(svc.url + "/sdapi/v1/img2img", json={**body, "override_settings": {"client_dry": 1,
                                                                                      "jpeg_quality": 33}},
                   headers={"X-Onecard-Dry-Run": "1"}, timeout=60)
    assert r.status_code == 200 and r.json()["valid"] is True
    assert "client_dry" not in options(svc) and options(svc)["jpeg_quality"] == 80
    # kept once it ran
    r = httpx.post(svc.url + "/sdapi/v1/img2img", json={**body, "override_settings": {"client_kept": 1}},
                   timeout=60)
    assert r.status_code == 200 and options(svc)["client_kept"] == 1


def test_the_store_encodes_each_version_once(monkeypatch):
    """A GET answers the bytes stored with the document: no copy, no encoding per read
    (the old GET deep-copied and JSON-encoded the whole store on the event loop)."""
    from services.img2img import webui_options
    calls = []
    real = webui_options.encode
    monkeypatch.setattr(webui_options, "encode", lambda doc: calls.append(1) or real(doc))
    store = OptionsStore({"samples_format": "png"}, max_keys=10, max_value_bytes=1000, max_bytes=10_000)
    store.update({"client": [1, 2, 3]})
    encoded, current = store.encoded, store.current
    made = len(calls)
    for _ in range(100):
        assert store.encoded is encoded and store.current is current
    assert len(calls) == made
    assert encoded == real({"samples_format": "png", "client": [1, 2, 3]})
    store.update({"samples_format": "webp"})
    assert store.current is not current and current["samples_format"] == "png"  # a reader's version never changes
