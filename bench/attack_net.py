"""Raw HTTP for hostile clients: requests whose bytes we choose, clients that never read,
connections held open. Plain sockets, no client library: a library would fix what we send.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

HOST = "127.0.0.1"


def head(method: str, path: str, headers: dict[str, str] | None = None, body_len: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body_len is not None:
        lines.append(f"Content-Length: {body_len}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_answer(s: socket.socket, deadline: float, keep_body: bool,
                 start: bytes = b"") -> tuple[int | None, bytes, str | None]:
    """Status and body of one answer (read until its Content-Length, or the close). Without
    keep_body only the first 4 kB of the body are kept: big answers are counted, not held."""
    data = bytearray(start)
    head_end, length, body_bytes = -1, None, 0

    def parse_head() -> None:
        nonlocal head_end, length, body_bytes
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            for line in bytes(data[:head_end]).split(b"\r\n")[1:]:
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body_bytes = len(data) - head_end - 4

    parse_head()
    while not (head_end >= 0 and length is not None and body_bytes >= length):
        left = deadline - time.monotonic()
        if left <= 0:
            return _status(data), b"", "timeout"
        s.settimeout(left)
        try:
            chunk = s.recv(1 << 20)
        except TimeoutError:
            return _status(data), b"", "timeout"
        except OSError as exc:
            return _status(data), b"", type(exc).__name__
        if not chunk:
            break
        if head_end < 0:
            data += chunk
            parse_head()
        else:
            body_bytes += len(chunk)
            if keep_body or len(data) < head_end + 4 + 4096:
                data += chunk
    body = bytes(data[head_end + 4:]) if head_end >= 0 else b""
    return _status(data), body, None


def _status(data: bytes | bytearray) -> int | None:
    if data.startswith(b"HTTP/1.") and len(data) >= 12:
        try:
            return int(bytes(data[9:12]))
        except ValueError:
            return None
    return None


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            timeout: float = 300.0, keep_body: bool = True) -> dict[str, Any]:
    """One request on a fresh connection, the answer read whole (or its head and first 4 kB)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    hdrs = {"Connection": "close", **(headers or {})}
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(head(method, path, hdrs, len(body) if body or method in ("POST", "PUT") else None))
            if body:
                s.sendall(body)
            status, data, err = _read_answer(s, deadline, keep_body)
    except OSError as exc:
        status, data, err = None, b"", type(exc).__name__
    return {"status": status, "body": data, "error": err, "s": time.monotonic() - t0}


def post_json(port: int, path: str, doc: Any, timeout: float = 300.0, **kw) -> dict[str, Any]:
    return request(port, "POST", path, json.dumps(doc).encode(), {"Content-Type": "application/json"}, timeout, **kw)


def error_code(r: dict[str, Any]) -> str | None:
    try:
        doc = json.loads(r["body"])
    except (ValueError, TypeError):
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        return err.get("code")
    return err if isinstance(err, str) else None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def concurrently(fn: Callable[[int], dict[str, Any]], n: int, workers: int | None = None) -> list[dict[str, Any]]:
    with concurrent.futures.ThreadPoolExecutor(workers or n) as pool:
        return list(pool.map(fn, range(n)))


def tally(results: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Status codes (or the client-side error) with the error code: '413 too_costly': 3."""
    c: Counter[str] = Counter()
    for r in results:
        if r.get("status") is None:
            c[f"no answer ({r.get('error')})"] += 1
        else:
            code = error_code(r) if r["status"] >= 400 else None
            c[f"{r['status']}" + (f" {code}" if code else "")] += 1
    return dict(c)


def count_5xx(statuses: dict[str, int]) -> int:
    return sum(n for k, n in statuses.items() if k[:1] == "5")


class Holder:
    """Connections that send `payload` (maybe nothing) and then never read: their answers pile up
    in the server's buffers until it gives up on them. SO_RCVBUF is set small before connecting,
    so that the kernel of this side takes almost nothing off the server."""

    def __init__(self, port: int, payload: bytes, n: int, rcvbuf: int = 4096, host: str = HOST):
        self.port, self.payload, self.n, self.rcvbuf, self.host = port, payload, n, rcvbuf, host
        self.socks: list[socket.socket] = []
        self.failed = 0

    def open(self) -> Holder:
        for _ in range(self.n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            s.settimeout(10)
            try:
                s.connect((self.host, self.port))
                if self.payload:
                    s.sendall(self.payload)
                self.socks.append(s)
            except OSError:
                self.failed += 1
                s.close()
        return self

    def reset_by_server(self) -> int:
        """How many of them the server has closed or reset: what is buffered on this side is
        read away first (a late answer sits in front of the EOF or the reset)."""
        n = 0
        for s in self.socks:
            s.setblocking(False)
            try:
                while True:
                    if s.recv(1 << 20) == b"":
                        n += 1
                        break
            except BlockingIOError:
                pass
            except OSError:
                n += 1
        return n

    def close(self) -> None:
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass
        self.socks = []


def trickle(port: int, first: bytes, piece: bytes, every_s: float, stop: threading.Event,
            max_bytes: int = 1 << 30) -> dict[str, Any]:
    """Send `first`, then `piece` every `every_s` until the server answers or closes, `stop` is
    set, or max_bytes went out; what came back and how many bytes it took."""
    sent = 0
    t0 = time.monotonic()
    try:
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(first)
            sent += len(first)
            s.setblocking(False)
            while not stop.is_set() and sent < max_bytes:
                try:
                    got = s.recv(65536)
                    if not got:
                        return {"status": None, "body": b"", "error": "closed", "sent": sent,
                                "s": time.monotonic() - t0}
                    s.setblocking(True)
                    status, body, err = _read_answer(s, time.monotonic() + 5, True, got)
                    return {"status": status, "body": body, "error": err, "sent": sent, "s": time.monotonic() - t0}
                except BlockingIOError:
                    pass
                s.setblocking(True)
                s.settimeout(10)
                try:
                    s.sendall(piece)
                    sent += len(piece)
                except OSError as exc:
                    got = b""
                    try:  # the answer may have come before the close that failed our send
                        s.setblocking(False)
                        got = s.recv(65536)
                    except OSError:
                        pass
                    return {"status": _status(got), "body": got, "error": None if got else type(exc).__name__,
                            "sent": sent, "s": time.monotonic() - t0}
                s.setblocking(False)
                if every_s:
                    stop.wait(every_s)
            s.settimeout(15)
            status, body, err = _read_answer(s, time.monotonic() + 15, True)
            return {"status": status, "body": body, "error": err, "sent": sent, "s": time.monotonic() - t0}
    except OSError as exc:
        return {"status": None, "body": b"", "error": type(exc).__name__, "sent": sent, "s": time.monotonic() - t0}
