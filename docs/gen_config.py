"""Writes docs/configuration.md, the configuration reference, from the settings classes
themselves: every key with its type, default, bounds and description.

    .venv/bin/python docs/gen_config.py            # rewrite docs/configuration.md
    .venv/bin/python docs/gen_config.py --check    # exit 1 when the committed page is stale

tests/unit/test_docs_site.py fails when the committed page differs from what this writes, so a
new key (or a changed default or bound) reaches the docs in the same commit as the code.

The descriptions come from the code: a pydantic Field's description, or for the supervisor's
plain dataclasses the comment beside or above the field. NOTES adds what the code does not
say (what a key interacts with, a pointer to the page that explains it); a note for a key
that no longer exists is an error, so the notes cannot drift away from the code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "configuration.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# What the README's key tables said beyond the code's own descriptions, keyed by
# "section.key" as sections() names the sections.
NOTES: dict[str, str] = {
    "supervisor.drain_s": "passed to each service as `ONECARD_DRAIN_S`; must be below `grace_s` "
                          "([timeouts nest](operating.md#the-supervisors-contract))",
    "supervisor.health_port": "answers only `/healthz`, `/readyz` and `/metrics` ([operating.md](operating.md))",
    "supervisor.control_socket": "mode 0600; an existing directory is used as it is, a missing one is made 0700",
    "supervisor.run_dir": "made 0700, refused if it exists and is not private: probe sockets, MPS pipes",
    "supervisor.containment": "[supervisor.md](supervisor.md)",
    "supervisor.sample_period_s": "also how soon a deleted control socket comes back",
    "supervisor.log_format": "also `--log-format`",
    "gpu.visible_devices": "GPU figures and byte budgets use the first card it names",
    "gpu.mps_dir": "the daemon's private `pipe/` and `log/` directories ([gpu.md](gpu.md))",
    "service.port": "required; unique across the unit",
    "service.threads": "`auto` shares the container's CPU quota ([gpu.md](gpu.md#cpu-quota-and-threads))",
    "service.env": "a service inherits the supervisor's environment except its `ONECARD_*` variables (they "
                   "are the supervisor's), so a variable of that name reaches a service only from here",
    "service.enabled": "false leaves the service out",
    "service.gpu_memory_fraction": "the fractions of all services may add up to at most 1.0",
    "service.memory_fraction": "passed as `ONECARD_MEMORY_BUDGET_BYTES`; the fractions may add up to at most "
                               "0.9; the default config gives img2img 0.5 and detect 0.2 "
                               "([cost-model.md](cost-model.md))",
    "service.settings": "its keys are below; `onecard check` validates it too",
    "runtime.max_connections": "the code is `too_many_connections`; a newcomer whose request has begun waits "
                               "in line first (`connection_queue_timeout_s`); a refusal is answered after "
                               "0.5-1 s and lingers at most 1 s; the soft "
                               "`RLIMIT_NOFILE` is raised to the hard limit at start and the cap lowered to fit "
                               "([limits.md](limits.md))",
    "runtime.header_timeout_s": "counted from the connection for the first request, from its first byte for a "
                                "later one, for a pipelined one from when the earlier answers are out",
    "runtime.max_body_bytes": "code `body_too_large`, declared or chunked",
    "runtime.max_json_depth": "code `json_too_deep`",
    "runtime.api_key": "`Authorization: Bearer` or `X-API-Key`, compared in constant time; probes stay open",
    "runtime.basic_auth_env": "the webui's `--api-auth` format (comma or newline separated); never printed",
    "model.max_queue": "counted the moment a request arrives, before its body is read; the 503 has `Retry-After`; "
                       "0: only to an idle model",
    "model.max_batch_size": "detect: images; img2img: compatible pictures ([batching.md](batching.md))",
    "model.request_timeout_s": "an img2img generation past it stops between steps",
    "model.max_held_bytes": "([cost-model.md](cost-model.md))",
    "model.max_request_bytes": "413 `too_costly` with the figures",
    "model.max_pixels": "413 `too_many_pixels`",
    "model.max_jpeg_scans": "413 `image_too_complex`, found by a marker walk before decoding",
    "model.max_image_markers": "413 `image_too_complex`: also more PNG ancillary chunks, or more PNG data chunks "
                               "under 256 bytes",
    "model.max_fields": "422 beyond",
    "model.cpu_workers": "the bounded pool for decode, resize, encode, base64, JSON and multipart parsing, "
                         "psutil/NVML",
    "model.device": "`cuda` fails at start when the CUDA libraries do not load (onnxruntime otherwise falls back "
                    "silently); `auto` on a host with a GPU that ends up on the CPU says so in `/info` "
                    "(`device_warning`) and the log",
    "model.model_label": "the label `/info` reports; the jobs queue routes by it",
    "jobs.targets": "`$ONECARD_UNIT_SERVICES` (set by the supervisor) wins for the URLs",
    "jobs.max_result_bytes": "not retried; at most `queue.max_results_bytes`",
    "queue.url_env": "not an `ONECARD_*` name, which the supervisor keeps from its services (e.g. "
                     "`JOBS_QUEUE_URL`); unset or empty stops the service at start (exit 78, the message names "
                     "the variable)",
    "queue.max_connections": "the consumers' blocking reads have a pool of the same size, plus one pub/sub "
                             "connection",
    "queue.max_queued_bytes": "on Redis, bound its memory with `maxmemory` and `noeviction` instead: a Redis at "
                              "its `maxmemory` makes a submit 503 `queue_full`",
    "target.routes": "with an OpenAPI document, only the listed ones that it declares as JSON POST routes",
}


@dataclasses.dataclass
class Section:
    key: str                 # the prefix NOTES uses
    title: str
    intro: str
    cls: type
    only_own: bool = False   # list only what this class declares (a subclass of a listed class)


def sections() -> list[Section]:
    from services.detect.settings import DetectSettings
    from services.img2img.settings import Img2ImgSettings
    from services.jobs.settings import JobsSettings, QueueSettings, TargetSettings
    from services.runtime.pipeline.settings import ModelServiceSettings
    from services.runtime.settings import ServiceSettings as RuntimeSettings
    from supervisor.config.schema import ServiceSettings
    from supervisor.config.settings import GpuSettings, SupervisorSettings
    return [
        Section("supervisor", "`[supervisor]`", "The supervisor itself.", SupervisorSettings),
        Section("gpu", "`[gpu]`", "The card and NVIDIA MPS ([gpu.md](gpu.md)).", GpuSettings),
        Section("service", "`[services.NAME]`", "One block per service: how the supervisor starts it and "
                "what it may use. Exactly one of `app` and `command`; at most one of each fraction/bytes pair.",
                ServiceSettings),
        Section("runtime", "`[services.NAME.settings]`: every service",
                "What every onecard service shares, the jobs service included: the HTTP edge's limits "
                "([limits.md](limits.md)), credentials, the event loop's watchdog "
                "(`services.runtime.settings.ServiceSettings`).", RuntimeSettings),
        Section("model", "`[services.NAME.settings]`: every model service",
                "What a model service adds: the queue, batching, deadlines, memory budgets "
                "([cost-model.md](cost-model.md)), input limits, the CPU pool and the device "
                "(`onecard.Settings`; detect, img2img and a service of your own).", ModelServiceSettings,
                only_own=True),
        Section("detect", "`[services.detect.settings]`", "The face detection service's own keys.",
                DetectSettings, only_own=True),
        Section("img2img", "`[services.img2img.settings]`", "The img2img service's own keys, and the defaults it "
                "changes ([webui.md](webui.md) for the webui API's limits).", Img2ImgSettings, only_own=True),
        Section("jobs", "`[services.jobs.settings]`", "The jobs service's own keys, and the defaults it changes "
                "([jobs.md](jobs.md)); it has every service's connection limits, credentials and loop watchdog "
                "(above), and its probes are served on the private unix socket too. Its queue table is "
                "`[services.jobs.settings.queue]`, because the supervisor's top level is strict.", JobsSettings,
                only_own=True),
        Section("queue", "`[services.jobs.settings.queue]`", "The queue: without `url` (or `url_env`) the jobs "
                "stay in the jobs service's memory; with one, on Redis Streams ([many-units.md](many-units.md)).",
                QueueSettings),
        Section("target", "`[services.jobs.settings.targets.NAME]`", "A service jobs run on, as a table (or "
                "just its URL as a string).", TargetSettings),
    ]


# --- reading a field -------------------------------------------------------------------------

def _comments(cls: type) -> dict[str, str]:
    """The comment beside a dataclass field, else the comment lines right above it."""
    source = inspect.getsource(cls)
    tree = ast.parse(source).body[0]
    beside: dict[int, str] = {}
    whole_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (whole_line if tok.line.strip().startswith("#") else beside)[tok.start[0]] = text
    out = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.end_lineno in beside:
                out[node.target.id] = beside[node.end_lineno]
                continue
            above, line = [], node.lineno - 1
            while line in whole_line:
                above.insert(0, whole_line[line])
                line -= 1
            if above:
                out[node.target.id] = " ".join(above)
    return out


def _fields(cls: type) -> dict[str, Any]:
    """name -> pydantic FieldInfo, for a BaseModel and for a plain dataclass alike."""
    from pydantic.fields import FieldInfo
    if hasattr(cls, "model_fields"):
        return dict(cls.model_fields)
    hints = typing.get_type_hints(cls, include_extras=True)
    out = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else ...
        info = FieldInfo.from_annotated_attribute(hints[f.name], default)
        out[f.name] = info
    return out


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{_plain(a)}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " \\| ".join(_type(a) for a in args)
    if origin is typing.Annotated:
        return _type(typing.get_args(annotation)[0])
    if origin is dict:
        return "table"
    if origin is list:
        return "list"
    if isinstance(annotation, type):
        if hasattr(annotation, "model_fields"):
            return "table"
        return {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__)
    return str(annotation)


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _number(value: Any, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _plain(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if name.endswith("_bytes") and isinstance(value, int) and value >= 1024:
        for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value % size == 0:
                return f"{value // size} {unit}"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}".replace(",", " ")
    if isinstance(value, int) and value > 2**20 and (value & (value - 1)) == 0:
        return f"2^{value.bit_length() - 1}"
    return str(value)


# defaults that depend on the machine that writes the page
DEFAULT_TEXT = {"supervisor.control_socket": "`/tmp/onecard-$UID/control.sock`"}


def _default(info: Any, name: str, key: str) -> str:
    from pydantic import BaseModel
    if key in DEFAULT_TEXT:
        return DEFAULT_TEXT[key]
    if info.default_factory is not None:
        value = info.default_factory()
        if isinstance(value, BaseModel):
            return "its table below"
        return "—" if not value else f"`{value}`"
    if info.default is ... or info.is_required():
        return "required"
    if info.default is None:
        return "—"
    return f"`{_number(info.default, name)}`"


def _bounds(info: Any, name: str) -> str:
    parts = []
    for m in info.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(m, attr, None) is not None and type(m).__name__.lower() == attr:
                parts.append(f"{sign} {_number(getattr(m, attr), name)}")
        if type(m).__name__ == "MaxLen":
            parts.append(f"at most {m.max_length} long")
        pattern = getattr(m, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Written by docs/gen_config.py from the settings classes; do not edit by hand. -->",
        "",
        "Every key of the TOML configuration, generated from the settings classes (their defaults, "
        "bounds and descriptions), so it is always the code's. How the file is found, overrides "
        "(`ONECARD_*` variables, `--set`) and `onecard check`: [config-files.md](config-files.md). "
        "A value outside its bounds, an unknown key or a wrong type is an error naming the file and "
        "the key (exit 2).",
        "",
    ]
    known_notes: set[str] = set()
    for section in sections():
        fields = _fields(section.cls)
        comments = _comments(section.cls) if dataclasses.is_dataclass(section.cls) else {}
        own = set(section.cls.__dict__.get("__annotations__", {})) if section.only_own else set(fields)
        lines += [f"## {section.title}", "", section.intro, "",
                  "| key | type | default | bounds | meaning |", "| --- | --- | --- | --- | --- |"]
        for name, info in fields.items():
            if name not in own:
                continue
            key = f"{section.key}.{name}"
            known_notes.add(key)
            meaning = info.description or comments.get(name, "")
            note = NOTES.get(key)
            if note:
                meaning = f"{meaning}; {note}" if meaning else note
            parent = section.cls.__mro__[1]
            inherited = getattr(parent, "model_fields", {}).get(name)
            was = _default(inherited, name, key) if inherited is not None else None
            changed = f" (instead of {was})" if was is not None and was != _default(info, name, key) else ""
            lines.append(f"| `{name}` | {_type(info.annotation)} | {_default(info, name, key)}{changed} | "
                         f"{_cell(_bounds(info, name))} | {_cell(meaning)} |")
        lines.append("")
    unknown = sorted(set(NOTES) - known_notes)
    if unknown:
        raise SystemExit(f"docs/gen_config.py: NOTES for keys that do not exist: {', '.join(unknown)}")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("docs/configuration.md is stale: run .venv/bin/python docs/gen_config.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
