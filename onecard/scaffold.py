"""``onecard new-service NAME``: a working service skeleton in a new folder.

    NAME/
      NAME_service/__init__.py
      NAME_service/settings.py   the service's settings (pydantic only: `onecard check` reads them)
      NAME_service/app.py        the model: decode, predict (batched), encode; create_app
      tests/test_NAME_service.py starts the service as the supervisor would and sends a picture
      onecard.toml               the block to add to a unit's config

The skeleton's model measures a picture (its size and mean color) so that it runs, and
its test passes, before any model is put in. Standard library only: the CLI imports this
at once, and nothing here may load a web or ML library.
"""

from __future__ import annotations

import re
from pathlib import Path

NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,39}")

SETTINGS = '''"""The {name} service's settings: onecard's (limits, batching, deadlines, auth...) plus its own
keys, strictly typed. Pydantic only, so that `onecard check` validates the section before
anything starts."""

from __future__ import annotations

from pydantic import Field

import onecard


class {cls}Settings(onecard.Settings):
    round_to: int = Field(2, ge=0, le=6, description="digits kept in the answer's figures")


SERVICE_SETTINGS = {cls}Settings
'''

APP = '''"""POST {route}: what the {name} model says about a picture.

Replace setup() and predict() with your model; keep the shape: decode (CPU pool) ->
predict on a batch (the model's thread, under the service's FIFO lock) -> encode (CPU pool).
Reference: docs/services/api.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field

import onecard
from {package}.settings import {cls}Settings


class {cls}Params(onecard.Params):
    channel: onecard.Str = Field("all", pattern="^(all|red|green|blue)$", description="the color channel to measure")


class {cls}(onecard.Model):
    """Send a picture (raw body, multipart field `image`, or base64 JSON); get its size and mean color."""

    batching = True          # predict() gets the items of several requests at once
    Settings = {cls}Settings
    Params = {cls}Params
    settings: {cls}Settings

    def setup(self, ctx: onecard.Setup) -> None:
        # load your model here: ctx.device ("cpu" or "cuda"), ctx.threads,
        # ctx.gpu_memory_budget_bytes, ctx.onnx_session(path) for an ONNX model
        self.channels = {{"all": slice(None), "red": 0, "green": 1, "blue": 2}}

    def warmup_inputs(self) -> list[Any]:
        return [(np.full((64, 64, 3), 128, np.uint8), "all")]

    def decode_request(self, request: onecard.Request) -> tuple[np.ndarray, str]:
        params = request.params()      # first the parameters (422 before any decode)
        return request.image(), params.channel

    def predict(self, items: list[tuple[np.ndarray, str]], call: onecard.Call) -> list[Any]:
        return [{{"width": rgb.shape[1], "height": rgb.shape[0],
                 "mean": float(rgb[:, :, self.channels[channel]].mean())}} for rgb, channel in items]

    def encode_response(self, output: dict[str, Any], request: onecard.Request) -> dict[str, Any]:
        return {{**output, "mean": round(output["mean"], self.settings.round_to)}}


create_app = onecard.serve({cls}, route="{route}")
'''

TEST = '''"""The {name} service, started as the supervisor would start it, answers a picture in each
input form and refuses a bad parameter in the error envelope. Run: pytest tests"""

from __future__ import annotations

from pathlib import Path

import pytest

from onecard.testing import ServiceProcess, assert_error, picture

HERE = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def service():
    with ServiceProcess("{package}.app:create_app", {{"round_to": 1}}, name="{name}", pythonpath=[HERE]) as svc:
        yield svc


@pytest.mark.parametrize("form", ["raw", "multipart", "json"])
def test_measures_a_picture(service, form):
    r = service.post_image("{route}", picture(40, 30, color=(200, 100, 50)), form=form, params={{"channel": "red"}})
    assert r.status_code == 200, r.text
    assert r.json() == {{"width": 40, "height": 30, "mean": 200.0}}


def test_refuses_a_bad_parameter(service):
    assert_error(service.post_image("{route}", picture(), params={{"channel": "purple"}}), 422,
                 "invalid_parameter", "channel")
'''

CONFIG = '''# Add this block to the unit's config. PYTHONPATH makes the folder that holds
# {package}/ importable by the service: write its absolute path.
[services.{name}]
app = "{package}.app:create_app"
port = {port}
threads = "auto"
env = {{ PYTHONPATH = "{folder}" }}

[services.{name}.settings]
round_to = 2
max_batch_size = 8
'''


def write_service(name: str, directory: str | Path | None = None, route: str | None = None,
                  port: int = 7870) -> list[Path]:
    """Write the skeleton of service NAME into ``directory`` (default ./NAME), which must not
    exist yet or be empty; the files written, in order."""
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"{name!r}: a service name is lower-case letters, digits and '_', starting with a letter "
                         f"(at most 40)")
    folder = Path(directory if directory is not None else name).resolve()
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty")
    route = route or f"/api/v1/{name}"
    if not re.fullmatch(r"(/[A-Za-z0-9_.-]+)+", route):
        raise ValueError(f"{route!r}: a route is a path such as /api/v1/{name}")
    package = f"{name}_service"
    cls = "".join(part.capitalize() for part in name.split("_")) or "Service"
    fields = {"name": name, "package": package, "cls": cls, "route": route, "port": port, "folder": str(folder)}
    files = {
        folder / package / "__init__.py": f'"""The {name} service for a onecard unit."""\n',
        folder / package / "settings.py": SETTINGS.format(**fields),
        folder / package / "app.py": APP.format(**fields),
        folder / "tests" / f"test_{package}.py": TEST.format(**fields),
        folder / "onecard.toml": CONFIG.format(**fields),
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(files)
