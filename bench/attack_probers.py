"""Probers for the attack soak, each run as its own process so that the load generator's GIL
never delays a probe (a late probe would be blamed on the unit).

    python -m bench.attack_probers orchestrator --port 7860 --out probes.jsonl
    python -m bench.attack_probers public --port 7861 --port 7862 --out public.jsonl

orchestrator: what a kubelet does: GET /healthz and GET /readyz on the supervisor's probe port
once a second each (independently, as liveness and readiness probes are), a new connection
every time, 1 s timeout for connect + answer; 200-399 is a success.
public: GET /healthz on each service's own port every 50 ms (one thread per port), a new
connection every time, 2 s timeout; the latency of every probe.
legit: a small legitimate request once a second per target (a 64x64 PNG to detect's
/api/v1/facedetect and to img2img's /api/v1/img2img), 120 s timeout: what an ordinary
client meets while the unit is under attack.

Every probe is one JSON line {"t": monotonic, "kind": ..., "port": p, "path": ..., "ok": bool,
"status": code or null, "ms": latency, "error": text or null}; CLOCK_MONOTONIC is the same
clock in every process, so the soak cuts these lines into attack windows.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import struct
import sys
import threading
import time
import zlib

LEGIT_PATHS = {"detect": "/api/v1/facedetect", "img2img": "/api/v1/img2img?style=3"}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def small_png() -> bytes:
    """A 64x64 gradient PNG, built here: this process imports nothing heavy."""
    raw = b"".join(b"\x00" + bytes((x * 4 + y) % 256 for x in range(64 * 3)) for y in range(64))
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b""))


def probe_once(host: str, port: int, path: str, timeout: float,
               body: bytes | None = None) -> tuple[int | None, str | None]:
    """(status, None) or (None, why): one HTTP/1.1 request on a fresh connection (GET, or a POST
    of a PNG when `body` is given), the whole answer read."""
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            if body is None:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                          f"User-Agent: kube-probe/1.30\r\n\r\n".encode())
            else:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                          f"Content-Type: image/png\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            data = b""
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, "timeout"
                s.settimeout(left)
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                head, sep, body = data.partition(b"\r\n\r\n")
                if sep:  # done once the declared body is in (the server may keep the socket open)
                    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                                   if line.lower().startswith(b"content-length:")), None)
                    if length is not None and len(body) >= length:
                        break
        if not data.startswith(b"HTTP/1."):
            return None, "no answer" if not data else "not HTTP"
        status = int(data.split(b" ", 2)[1])
        if status >= 400:  # the error code says which limit refused it
            found = re.search(rb'"code":\s*"([a-z_]+)"', data)
            return status, found.group(1).decode() if found else None
        return status, None
    except TimeoutError:
        return None, "timeout"
    except OSError as exc:
        return None, type(exc).__name__


def loop(kind: str, host: str, port: int, path: str, period: float, timeout: float, out, lock,
         body: bytes | None = None) -> None:
    nxt = time.monotonic()
    while True:
        t0 = time.monotonic()
        status, err = probe_once(host, port, path, timeout, body)
        ms = (time.monotonic() - t0) * 1000
        line = json.dumps({"t": t0, "kind": kind, "port": port, "path": path,
                           "ok": status is not None and 200 <= status < 400, "status": status,
                           "ms": round(ms, 2), "error": err})
        with lock:
            out.write(line + "\n")
            out.flush()
        nxt += period
        delay = nxt - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:  # a probe that ran long: the next one is due now, no burst to catch up
            nxt = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("orchestrator", "public", "legit"))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, action="append", required=True)
    ap.add_argument("--service", action="append", default=[], help="legit: the service of each --port")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = open(args.out, "a", buffering=1)
    lock = threading.Lock()
    body = None
    if args.kind == "orchestrator":
        jobs = [(args.port[0], "/healthz", 1.0, 1.0), (args.port[0], "/readyz", 1.0, 1.0)]
    elif args.kind == "public":
        jobs = [(p, "/healthz", 0.05, 2.0) for p in args.port]
    else:
        body = small_png()
        jobs = [(p, LEGIT_PATHS[name], 1.0, 120.0) for p, name in zip(args.port, args.service, strict=True)]
    threads = [threading.Thread(target=loop, args=(args.kind, args.host, p, path, period, timeout, out, lock, body),
                                daemon=True) for p, path, period, timeout in jobs]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.05 / max(1, len(threads)) * (i + 1) if args.kind == "public" else 0.5)  # spread them out
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
