"""`onecard status`: ask the running supervisor over its control socket and show the answer.

Imports nothing heavy (no pydantic, no ML library) so that it answers in well under
half a second and can serve as an exec probe. Exit codes: 0 every service ready,
1 not all ready, 2 no supervisor reachable. `onecard stop` uses the same channel.

The socket is found like every command finds its config (config/location.py): ``--socket``,
else ``$ONECARD_CONTROL_SOCKET``, else the config's ``supervisor.control_socket``
(``--config``, else ``$ONECARD_CONFIG``, else the built-in default; overridden by
``$ONECARD_SUPERVISOR__CONTROL_SOCKET`` as `run` would be).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

from supervisor.config.location import DEFAULT_CONTROL_SOCKET, resolve

EXIT_READY, EXIT_NOT_READY, EXIT_UNREACHABLE = 0, 1, 2


class Unreachable(Exception):
    pass


def socket_path(explicit: str | None, config_option: str | None, environ=None) -> str:
    environ = os.environ if environ is None else environ
    if explicit:
        return explicit
    if environ.get("ONECARD_CONTROL_SOCKET"):
        return environ["ONECARD_CONTROL_SOCKET"]
    source = resolve(config_option, environ)
    found = None
    import tomllib
    try:
        with open(source.path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise Unreachable(f"{source.describe()}: no such file") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise Unreachable(f"{source.describe()}: cannot read: {exc}") from None
    section = doc.get("supervisor", {})
    if isinstance(section, dict) and isinstance(section.get("control_socket"), str):
        found = section["control_socket"]
    override = environ.get("ONECARD_SUPERVISOR__CONTROL_SOCKET")
    if override:
        found = override[1:-1] if len(override) > 1 and override[0] == override[-1] == '"' else override
    return found or DEFAULT_CONTROL_SOCKET


def _connect(s: socket.socket, path: str, deadline: float) -> None:
    """connect(), waiting while the supervisor's listen queue is full (EAGAIN on a unix
    socket) instead of giving up at once: a crowd of callers is answered in turn."""
    pause = 0.005
    while True:
        try:
            s.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + pause >= deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


class _ClosedEarly(Exception):
    """Closed before any byte of an answer: made room for a newcomer, or was too slow."""


def _ask(path: str, command: str, deadline: float) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        _connect(s, path, deadline)
        s.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                if chunks:
                    raise
                raise _ClosedEarly() from None
            if not data:
                break
            chunks.append(data)
        if not chunks:
            raise _ClosedEarly()
        return b"".join(chunks)
    finally:
        s.close()


def fetch(path: str, timeout: float = 2.0, command: str = "status") -> dict[str, Any]:
    """One command's answer. A connection the supervisor closed before answering (it makes
    room for newcomers when every slot is taken) is tried again until the deadline: both
    commands may be asked twice."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            raw = _ask(path, command, deadline)
            break
        except _ClosedEarly:
            if time.monotonic() >= deadline:
                raise Unreachable(f"no onecard supervisor answers on {path}: closed without an answer") from None
            time.sleep(0.01)
        except FileNotFoundError:
            raise Unreachable(f"no onecard supervisor: {path} does not exist") from None
        except (TimeoutError, ConnectionRefusedError, PermissionError, OSError) as exc:
            raise Unreachable(f"no onecard supervisor answers on {path}: {exc}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise Unreachable(f"garbled answer on {path}") from None


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}M"


def _num(v: Any, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


def _dur(v: Any) -> str:
    if v is None:
        return "-"
    v = int(v)
    if v < 120:
        return f"{v}s"
    if v < 7200:
        return f"{v // 60}m{v % 60:02d}s"
    return f"{v // 3600}h{(v % 3600) // 60:02d}m"


COLUMNS = ("SERVICE", "PID", "PORT", "STATE", "UPTIME", "CPU%", "RSS", "GPU MEM",
           "QUEUE", "INFLIGHT", "SERVED", "P50 MS", "P99 MS")


def render_table(doc: dict[str, Any]) -> str:
    rows = []
    for s in doc.get("services", []):
        rows.append((
            s["name"], _num(s["pid"], "{}"), str(s["port"]), s["state"], _dur(s["uptime_s"]),
            _num(s["cpu_percent"], "{:.1f}"), _mib(s["rss_bytes"]), _mib(s["gpu_memory_bytes"]),
            _num(s["queue_depth"], "{}"), _num(s["in_flight"], "{}"), _num(s["served"], "{}"),
            _num(s["latency_p50_ms"], "{:.1f}"), _num(s["latency_p99_ms"], "{:.1f}"),
        ))
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    sup = doc.get("supervisor", {})
    cpu = doc.get("cpu", {})
    gpu = doc.get("gpu", {})
    lines.append("")
    lines.append(f"supervisor pid {sup.get('pid')}  {sup.get('state')}  up {_dur(sup.get('uptime_s'))}  "
                 f"rss {_mib(sup.get('rss_bytes'))}"
                 + (f"  stopping: {sup['stop_reason']}" if sup.get("stop_reason") else ""))
    quota = cpu.get("quota")
    thr = cpu.get("throttling")
    lines.append(f"cpu  {cpu.get('cpus', 0):g} usable ({cpu.get('source')}; affinity {cpu.get('affinity')}, "
                 f"quota {'none' if quota is None else f'{quota:g}'}), {cpu.get('threads_planned')} threads planned"
                 + (f"; throttled {100 * thr['throttled_share_1m']:.1f}% of periods, "
                    f"{thr['throttled_s_1m']:.2f} s in the last {thr['window_s']:g} s" if thr else ""))
    if gpu.get("available"):
        util = gpu.get("utilization_percent")
        lines.append(f"gpu  {gpu.get('name')}  {_mib(gpu.get('memory_used_bytes'))} / "
                     f"{_mib(gpu.get('memory_total_bytes'))}" + ("" if util is None else f"  {util}% busy"))
    else:
        lines.append(f"gpu  none ({gpu.get('reason', 'no GPU')})")
    mps = doc.get("mps") or {}
    if mps.get("enabled"):
        lines.append(f"mps  {'running' if mps.get('running') else 'not running'}"
                     + (f" pid {mps['pid']}" if mps.get("pid") else "") + f" ({mps.get('pipe_dir')})")
    dropped = sup.get("log_lines_dropped")
    if dropped:
        lines.append(f"logs  {dropped} lines dropped (stdout did not keep up)")
    for s in doc.get("services", []):
        if isinstance(s.get("batching"), dict):
            lines.append(f"batching {s['name']}  {_batching_line(s['batching'])}")
    for s in doc.get("services", []):
        if isinstance(s.get("jobs"), dict):
            lines.append(f"jobs {s['name']}  {_jobs_line(s['jobs'])}")
    return "\n".join(lines)


def _batching_line(b: dict[str, Any]) -> str:
    """policy, what it chose, what it waited, the learned curve, the memory held against its budget."""
    parts = [str(b.get("policy") or "-")]
    if b.get("batches"):
        parts.append(f"{b['batches']} calls of {_num(b.get('mean_batch_size'), '{:.2f}')} items")
    parts.append(f"waited {_num(b.get('waited_s'), '{:.2f}')} s")
    if b.get("fixed_ms") is not None:
        parts.append(f"curve {b['fixed_ms']:.1f} ms + {_num(b.get('per_extra_item_ms'), '{:.1f}')} ms an item")
    if b.get("held_budget_bytes"):
        parts.append(f"held {_mib(b.get('held_bytes'))} of {_mib(b['held_budget_bytes'])}")
    if b.get("refused_for_memory"):
        parts.append(f"{b['refused_for_memory']} refused for memory")
    return ", ".join(parts)


def _jobs_line(jobs: dict[str, Any], width: int = 100) -> str:
    """One short line: the scalar figures of a service's jobs section."""
    parts = [f"{k} {v}" for k, v in jobs.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    text = ", ".join(parts) or "-"
    return text if len(text) <= width else text[:width - 3] + "..."


def exit_code_for(doc: dict[str, Any]) -> int:
    return EXIT_READY if doc.get("supervisor", {}).get("all_ready") else EXIT_NOT_READY


def main(socket_arg: str | None, config_path: str | None, as_json: bool, watch: bool,
         interval: float, count: int = 0) -> int:
    try:
        path = socket_path(socket_arg, config_path)
    except Unreachable as exc:
        print(f"onecard status: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    doc: dict[str, Any] | None = None
    shown = 0
    try:
        while True:
            try:
                doc = fetch(path)
            except Unreachable as exc:
                print(f"onecard status: {exc}", file=sys.stderr)
                return EXIT_UNREACHABLE
            text = json.dumps(doc, indent=None if watch else 2) if as_json else render_table(doc)
            if not watch:
                print(text)
                return exit_code_for(doc)
            sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + path + "\n\n" + text + "\n")
            sys.stdout.flush()
            shown += 1
            if count and shown >= count:
                return exit_code_for(doc)
            time.sleep(interval)
    except KeyboardInterrupt:  # --watch ends with Ctrl-C (or --count)
        return EXIT_UNREACHABLE if doc is None else exit_code_for(doc)


def stop(socket_arg: str | None, config_path: str | None, wait: bool, timeout: float) -> int:
    """Ask the supervisor to stop gracefully (like SIGTERM); with wait, until it is gone."""
    try:
        path = socket_path(socket_arg, config_path)
        answer = fetch(path, command="stop")
    except Unreachable as exc:
        print(f"onecard stop: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if not answer.get("stopping"):
        print(f"onecard stop: unexpected answer {answer}", file=sys.stderr)
        return EXIT_NOT_READY
    print(f"onecard stop: supervisor pid {answer.get('pid')} is stopping")
    if not wait:
        return 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            fetch(path, timeout=1.0)
        except Unreachable:
            print("onecard stop: stopped")
            return 0
        time.sleep(0.2)
    print(f"onecard stop: still running after {timeout:g} s", file=sys.stderr)
    return EXIT_NOT_READY
