"""The public API's compatibility: the names of ``onecard`` and ``onecard.testing`` and the
signature of every public callable (and of the hooks and methods of its classes) are
pinned for API_VERSION in tests/data/onecard_api.json. A minor version may add names,
optional parameters and settings keys, a major one may change or remove them
(docs/services/api.md): either way the snapshot is regenerated on purpose
(``python -m tests.unit.test_onecard_api``) and API_VERSION bumped with it."""

from __future__ import annotations

import inspect
import json
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

SNAPSHOT = Path(__file__).resolve().parent.parent / "data" / "onecard_api.json"
RUNTIME_MADE = {"Request", "Service", "Setup", "Call"}  # a service gets these, never constructs them


def _members(cls: type) -> dict[str, str]:
    out = {}
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            out[name] = "property"
        elif inspect.isfunction(value):
            out[name] = str(inspect.signature(value))
    return out


def surface() -> dict[str, Any]:
    import onecard
    import onecard.testing
    from onecard._model import Model
    doc: dict[str, Any] = {"api_version": onecard.API_VERSION, "names": sorted(onecard.__all__),
                           "testing": sorted(onecard.testing.__all__), "signatures": {}, "model_attributes": {},
                           "settings_keys": sorted(onecard.Settings.model_fields)}
    sigs = doc["signatures"]
    for module, names in ((onecard, onecard.__all__), (onecard.testing, onecard.testing.__all__)):
        prefix = "testing." if module is onecard.testing else ""
        for name in names:
            if name in ("API_VERSION", "__version__"):
                continue
            value = getattr(module, name)
            if typing.get_origin(value) is typing.Annotated:  # Float, Int, Bool, Str: the type they check
                sigs[f"{prefix}{name}"] = f"Annotated[{typing.get_args(value)[0].__name__}]"
            elif name in ("Settings", "Params"):  # pydantic: their own helpers only
                sigs.update({f"{prefix}{name}.{m}": s for m, s in _members(value).items() if not m.startswith("model")})
            elif inspect.isclass(value):
                if name not in RUNTIME_MADE:
                    try:
                        sigs[f"{prefix}{name}"] = str(inspect.signature(value))
                    except ValueError:  # a builtin's subclass (Text is a str)
                        sigs[f"{prefix}{name}"] = f"class({value.__mro__[1].__name__})"
                sigs.update({f"{prefix}{name}.{m}": s for m, s in _members(value).items() if m != "__init__"})
            elif callable(value):
                sigs[f"{prefix}{name}"] = str(inspect.signature(value))
            else:
                sigs[f"{prefix}{name}"] = type(value).__name__
    doc["model_attributes"] = {k: repr(v) for k, v in vars(Model).items()
                               if not k.startswith("_") and not callable(v) and not isinstance(v, property)}
    return doc


def test_the_public_api_is_what_the_version_promises():
    pinned = json.loads(SNAPSHOT.read_text())
    now = surface()
    assert now["api_version"] == pinned["api_version"], "API_VERSION changed: regenerate the snapshot with it"
    assert now["names"] == pinned["names"] and now["testing"] == pinned["testing"]
    assert now["signatures"] == pinned["signatures"]
    assert now["model_attributes"] == pinned["model_attributes"]
    assert set(pinned["settings_keys"]) <= set(now["settings_keys"]), "a settings key was removed"


def test_import_onecard_promises_version_one():
    import onecard
    assert onecard.API_VERSION.split(".")[0] == "1"
    assert set(dir(onecard)) == set(onecard.__all__)
    for name in onecard.__all__:
        assert getattr(onecard, name) is not None


@pytest.mark.parametrize("status", [200, 204, 302, 399, 600, True, "404", 404.0])
def test_an_error_s_status_is_4xx_or_5xx(status):
    """onecard.Error(200, ...) answered 200 with the error envelope: a success to every client,
    and through the jobs API a "succeeded" job whose result was an error (helper-46)."""
    import onecard
    with pytest.raises(ValueError, match="4xx or 5xx"):
        onecard.Error(status, "x", "y")
    assert onecard.Error(404, "x", "y").status == 404 and onecard.Error(599, "x", "y").status == 599
    import numpy as np
    assert type(onecard.Error(np.int64(404), "x", "y").status) is int


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(surface(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}", file=sys.stderr)
