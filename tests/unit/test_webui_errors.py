"""An unexpected failure on a /sdapi path answers in the webui's shape (with its `detail`),
as the webui answers one; the runtime's handler still logs it under an id that the answer
quotes. Other paths keep the runtime's envelope."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.img2img.webui_routes import _server_errors_in_webui_shape
from services.runtime.shell.error_handlers import install_error_handlers


def test_server_errors_on_sdapi_paths_take_the_webui_shape(caplog):
    app = FastAPI()
    install_error_handlers(app)
    _server_errors_in_webui_shape(app)

    @app.get("/sdapi/v1/boom")
    async def boom():
        raise RuntimeError("model exploded")

    @app.get("/api/v1/boom")
    async def other():
        raise RuntimeError("other exploded")

    client = TestClient(app, raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR, logger="onecard.service"):
        r = client.get("/sdapi/v1/boom")
    assert r.status_code == 500
    doc = r.json()
    assert set(doc) == {"error", "detail", "body", "errors"} and doc["error"] == "internal_error"
    assert doc["detail"].startswith("unexpected error; quote id ") and doc["errors"] == f"500: {doc['detail']}"
    error_id = doc["detail"].split("quote id ")[1].split()[0]
    assert error_id in caplog.text and "model exploded" in caplog.text  # logged once, with the traceback
    assert "model exploded" not in r.text  # the answer carries no internals
    r = client.get("/api/v1/boom")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
