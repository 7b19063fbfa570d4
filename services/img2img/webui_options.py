"""The webui's settings (``/sdapi/v1/options``) for one process: typed, bounded, encoded once.

Keys that mean something here have a type and a range, checked as the webui's own
settings page would bound them; an integer written ``80.0`` is taken as 80 and an
integer where a fraction is expected as that number, anything else is a 422 naming
the key. A few keys describe this unit (its model's hash, its backend) and keep their
value whatever a client writes, so that a client that posts back the document it read
is not refused. Clients also store keys this service does not use: those are kept, but
bounded in count and in encoded size, and the whole stored document is bounded too
(413 beyond, naming the figure).

The stored document is never changed in place: an update builds the next one and its
JSON encoding together (in the CPU pool, where its caller runs it), so a GET answers
the bytes already encoded, with no copy and no encoding on the event loop, and a
reader always sees one consistent version.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onecard import Error
from services.img2img.params import parse_style

OUTPUT_FORMATS = {"png": "png", "jpg": "jpeg", "jpeg": "jpeg", "webp": "webp"}
PREVIEW_FORMATS = ("png", "jpeg", "webp")


@dataclass(frozen=True)
class Known:
    """A key that means something here: its type and bounds."""
    kind: str                       # "bool", "int", "float", "str", "choice", "style", "fixed"
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    max_chars: int = 1024


KNOWN: dict[str, Known] = {
    "sd_model_checkpoint": Known("str"),          # checked against this unit's model by the caller
    "sd_checkpoint_hash": Known("fixed"),
    "onecard_backend": Known("fixed"),
    "sd_vae": Known("str"),
    "CLIP_stop_at_last_layers": Known("int", 1, 12),
    "samples_format": Known("choice", choices=tuple(OUTPUT_FORMATS)),
    "jpeg_quality": Known("int", 1, 100),
    "enable_pnginfo": Known("bool"),
    "img2img_fix_steps": Known("bool"),
    "img2img_background_color": Known("str", max_chars=64),
    "inpainting_mask_weight": Known("float", 0.0, 1.0),
    "initial_noise_multiplier": Known("float", 0.0, 2.0),
    "live_previews_enable": Known("bool"),
    "live_previews_image_format": Known("choice", choices=PREVIEW_FORMATS),
    "show_progress_every_n_steps": Known("int", -1, 1000),
    "show_progress_type": Known("str", max_chars=64),
    "eta_noise_seed_delta": Known("int", 0, 2**32 - 1),
    "randn_source": Known("str", max_chars=64),
    "sd_checkpoint_cache": Known("int", 0, 100),
    "add_model_hash_to_info": Known("bool"),
    "add_model_name_to_info": Known("bool"),
    "add_version_to_infotext": Known("bool"),
    "onecard_style": Known("style"),
}


def _bad(where: str, key: str, why: str) -> Error:
    return Error(422, "invalid_parameter", f"{where}{key}: {why}")


def typed(key: str, value: Any, where: str = "") -> Any:
    """`value` for a known key, coerced where the webui's settings would take it; 422 otherwise."""
    spec = KNOWN[key]
    if spec.kind == "fixed":
        return value
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise _bad(where, key, "true or false")
        return value
    if spec.kind in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _bad(where, key, f"a number from {spec.lo:g} to {spec.hi:g}")
        if spec.kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise _bad(where, key, f"a whole number from {spec.lo:g} to {spec.hi:g}")
            value = int(value)
        else:
            value = float(value)
        if not spec.lo <= value <= spec.hi:
            raise _bad(where, key, f"a {'whole ' if spec.kind == 'int' else ''}number from {spec.lo:g} to "
                                   f"{spec.hi:g}, got {value:g}")
        return value
    if spec.kind == "choice":
        if not isinstance(value, str) or value.lower() not in spec.choices:
            raise _bad(where, key, f"one of {', '.join(spec.choices)}")
        return value
    if spec.kind == "style":
        try:
            parse_style(value)
        except ValueError as exc:
            raise _bad(where, key, str(exc)) from None
        return value
    if not isinstance(value, str):
        raise _bad(where, key, "a string")
    if len(value) > spec.max_chars:
        raise _bad(where, key, f"at most {spec.max_chars} characters")
    return value


def encode(doc: Any) -> bytes:
    """Compact UTF-8 JSON (the caller has refused lone surrogates, which UTF-8 cannot carry)."""
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


class OptionsStore:
    """The current settings document and its encoding, replaced whole on each update."""

    def __init__(self, defaults: dict[str, Any], *, max_keys: int, max_value_bytes: int, max_bytes: int,
                 on_change: Callable[[dict[str, Any]], None] | None = None):
        self.max_keys, self.max_value_bytes, self.max_bytes = max_keys, max_value_bytes, max_bytes
        self._fixed = {k: v for k, v in defaults.items() if k in KNOWN and KNOWN[k].kind == "fixed"}
        self._on_change = on_change
        self._lock = threading.Lock()
        self._doc = dict(defaults)
        self._encoded = encode(self._doc)
        if on_change is not None:
            on_change(self._doc)

    @property
    def current(self) -> dict[str, Any]:
        """The stored document. Never changed in place: read it, never write to it."""
        return self._doc

    @property
    def encoded(self) -> bytes:
        return self._encoded

    def typed(self, doc: dict[str, Any], where: str = "") -> dict[str, Any]:
        """`doc` with its known keys typed (422 naming the first one at fault) and the fixed ones
        kept at this unit's values; unknown keys as they are."""
        out = {}
        for key, value in doc.items():
            if key in self._fixed:
                out[key] = self._fixed[key]
            elif key in KNOWN:
                out[key] = typed(key, value, where)
            else:
                out[key] = value
        return out

    def check_unknown(self, doc: dict[str, Any], where: str = "") -> None:
        """Each unknown key's value within its size limit (413 naming the key and the figure)."""
        for key, value in doc.items():
            if key in KNOWN:
                continue
            size = len(encode(key)) + len(encode(value))
            if size > self.max_value_bytes:
                raise Error(413, "option_too_large", f"{where}{key[:64]}: {size} bytes encoded, over the limit of "
                                                        f"{self.max_value_bytes} bytes for one setting")

    def _merged(self, doc: dict[str, Any], where: str) -> tuple[dict[str, Any], bytes]:
        """The document `doc` would make, and its encoding; 413 when over a bound. Hold the lock."""
        merged = {**self._doc, **doc}
        unknown = sum(1 for k in merged if k not in KNOWN)
        if unknown > self.max_keys:
            raise Error(413, "too_many_options", f"{where}{unknown} settings this service does not use would "
                                                    f"be stored; the limit is {self.max_keys}")
        data = encode(merged)
        if len(data) > self.max_bytes:
            raise Error(413, "options_too_large", f"{where}the settings would take {len(data)} bytes "
                                                     f"encoded; the limit is {self.max_bytes}")
        return merged, data

    def check(self, doc: dict[str, Any], where: str = "") -> dict[str, Any]:
        """`doc` typed and within every bound as the store stands now, without storing it (CPU work)."""
        doc = self.typed(doc, where)
        self.check_unknown(doc, where)
        with self._lock:
            self._merged(doc, where)
        return doc

    def update(self, doc: dict[str, Any], where: str = "") -> None:
        """Type, bound, then replace the document and its encoding together (CPU work: runs in
        the CPU pool). The count and total size are checked against the document it replaces."""
        doc = self.typed(doc, where)
        self.check_unknown(doc, where)
        with self._lock:
            self._doc, self._encoded = self._merged(doc, where)
            if self._on_change is not None:  # under the lock: two updates apply in the order they stored
                self._on_change(self._doc)
