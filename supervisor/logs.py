"""Children's output and the supervisor's own messages, line by line, tagged by source."""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from typing import Callable, IO

MAX_LINE = 64 * 1024
SUPERVISOR_TAG = "onecard"


class LogSink:
    """Writes one tagged line at a time, as text (``name | line``) or one JSON object a line."""

    def __init__(self, fmt: str = "text", stream: IO[bytes] | None = None, width: int = 8):
        self.fmt = fmt
        self.stream = stream if stream is not None else sys.stdout.buffer
        self.width = width

    def line(self, source: str, text: str, level: str = "info") -> None:
        if self.fmt == "json":
            record = {"ts": round(time.time(), 3), "source": source, "level": level, "msg": text}
            out = json.dumps(record, ensure_ascii=False) + "\n"
        else:
            out = f"{source:<{self.width}} | {text}\n"
        try:
            self.stream.write(out.encode("utf-8", "replace"))
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # nobody reads our stdout any more; keep supervising

    def info(self, text: str) -> None:
        self.line(SUPERVISOR_TAG, text, "info")

    def warning(self, text: str) -> None:
        self.line(SUPERVISOR_TAG, text, "warning")

    def error(self, text: str) -> None:
        self.line(SUPERVISOR_TAG, text, "error")


class LineSplitter(asyncio.Protocol):
    """Reads a child's pipe; calls on_line for each complete line and on_eof at the end.

    A partial last line is flushed at EOF so that nothing is lost at shutdown; an
    over-long line is cut into MAX_LINE pieces rather than held without bound.
    """

    def __init__(self, on_line: Callable[[str], None], on_eof: Callable[[], None]):
        self._buf = bytearray()
        self._on_line = on_line
        self._on_eof = on_eof

    def data_received(self, data: bytes) -> None:
        self._buf.extend(data)
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) >= MAX_LINE:
                    self._emit(bytes(self._buf[:MAX_LINE]))
                    del self._buf[:MAX_LINE]
                    continue
                break
            self._emit(bytes(self._buf[:nl]))
            del self._buf[:nl + 1]

    def _emit(self, raw: bytes) -> None:
        self._on_line(raw.rstrip(b"\r").decode("utf-8", "replace"))

    def eof_received(self) -> bool:
        if self._buf:
            self._emit(bytes(self._buf))
            self._buf.clear()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_eof()


class Tail:
    """The last lines a child printed, for error messages that say why it failed."""

    def __init__(self, n: int = 20):
        self._lines: collections.deque[str] = collections.deque(maxlen=n)

    def add(self, line: str) -> None:
        self._lines.append(line)

    def lines(self) -> list[str]:
        return list(self._lines)
