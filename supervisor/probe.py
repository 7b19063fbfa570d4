"""A minimal asyncio HTTP GET for probing children: no client library, bounded in time and size."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

MAX_BODY = 256 * 1024


@dataclass(frozen=True)
class ProbeResult:
    status: int | None      # None: no HTTP answer (refused, timed out, garbled)
    body: bytes = b""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


async def _get(host: str, port: int, path: str) -> ProbeResult:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: onecard-probe\r\n"
            "Connection: close\r\n\r\n".encode("ascii")
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, _, header_block = head.decode("latin-1").partition("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            return ProbeResult(None, error=f"bad status line {status_line[:80]!r}")
        status = int(parts[1])
        length = None
        for line in header_block.split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        if length is not None:
            body = await reader.readexactly(min(length, MAX_BODY))
        else:
            body = await reader.read(MAX_BODY)
        return ProbeResult(status, body)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def http_get(host: str, port: int, path: str, timeout: float) -> ProbeResult:
    try:
        return await asyncio.wait_for(_get(host, port, path), timeout)
    except asyncio.TimeoutError:
        return ProbeResult(None, error=f"no answer within {timeout:g} s")
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        return ProbeResult(None, error=f"{type(exc).__name__}: {exc}")
