"""Children's output and the supervisor's own messages, line by line, tagged by source.

Writing never blocks the loop that supervises: lines go into a bounded buffer that one
writer thread empties into stdout. When stdout does not keep up (a pipe nobody reads, a
stuck log driver) new lines are dropped, counted, and the count is written as soon as
stdout moves again; the status document and /metrics show it too. A child is never
blocked either: its pipe is always read, whatever happens to our stdout.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from supervisor.system.signal_mask import quiet_thread

MAX_LINE = 64 * 1024
SUPERVISOR_TAG = "onecard"


class LogSink:
    """Tagged lines (``name | line``, or one JSON object a line) through a bounded buffer."""

    def __init__(self, fmt: str = "text", stream: IO[bytes] | None = None, width: int = 8,
                 max_lines: int = 10000, max_bytes: int = 16 * 2**20):
        self.fmt = fmt
        self.width = width
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._stream = stream
        self._fd = None if stream is not None else _stdout_fd()
        self._buf: collections.deque[bytes] = collections.deque()
        self._bytes = 0
        self._cv = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.dropped = 0           # lines dropped since start (status, /metrics)
        self._unreported = 0       # dropped lines not yet announced on stdout
        self.broken = False        # stdout is gone (EPIPE): everything is dropped

    # ---- producers (the loop) -----------------------------------------------------------
    def line(self, source: str, text: str, level: str = "info") -> None:
        data = self._format(source, text, level)
        with self._cv:
            if self.broken or len(self._buf) >= self.max_lines or self._bytes + len(data) > self.max_bytes:
                self.dropped += 1
                self._unreported += 1
                return
            self._buf.append(data)
            self._bytes += len(data)
            self._cv.notify()
        if self._thread is None:
            self._start()

    def lines(self, source: str, texts: list[str], level: str = "info") -> None:
        """Many lines of one source under one lock (a child's pipe read at once)."""
        if len(texts) == 1:
            return self.line(source, texts[0], level)
        data = [self._format(source, t, level) for t in texts]
        with self._cv:
            for item in data:
                if self.broken or len(self._buf) >= self.max_lines or self._bytes + len(item) > self.max_bytes:
                    self.dropped += 1
                    self._unreported += 1
                    continue
                self._buf.append(item)
                self._bytes += len(item)
            self._cv.notify()
        if self._thread is None:
            self._start()

    def info(self, text: str) -> None:
        self.line(SUPERVISOR_TAG, text, "info")

    def warning(self, text: str) -> None:
        self.line(SUPERVISOR_TAG, text, "warning")

    def error(self, text: str) -> None:
        self.line(SUPERVISOR_TAG, text, "error")

    def pending(self) -> int:
        with self._cv:
            return len(self._buf)

    def flush(self, timeout: float) -> bool:
        """Wait (bounded) until everything buffered is written; False when stdout is stuck.
        Called at exit, from the loop's last moments, never while supervising."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while (self._buf or self._busy) and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # ---- the writer thread ----------------------------------------------------------------
    def _format(self, source: str, text: str, level: str) -> bytes:
        if self.fmt == "json":
            record = {"ts": round(time.time(), 3), "source": source, "level": level, "msg": text}
            out = json.dumps(record, ensure_ascii=False) + "\n"
        else:
            out = f"{source:<{self.width}} | {text}\n"
        return out.encode("utf-8", "replace")

    def _start(self) -> None:
        with self._cv:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._writer, name="onecard-log-writer", daemon=True)
        self._thread.start()

    def _writer(self) -> None:
        quiet_thread()
        while True:
            with self._cv:
                while not self._buf and not self._unreported:
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait()
                self._busy = True
                batch = list(self._buf)
                self._buf.clear()
                self._bytes = 0
                lost, self._unreported = self._unreported, 0
            if lost:
                batch.insert(0, self._format(SUPERVISOR_TAG, f"{lost} log lines dropped: stdout did not keep up",
                                             "warning"))
            if not self._write(b"".join(batch)):
                with self._cv:
                    self.broken = True
                    self.dropped += len(batch)
                    self._buf.clear()
                    self._busy = False
                    self._cv.notify_all()
                return

    def _write(self, data: bytes) -> bool:
        try:
            if self._stream is not None:
                self._stream.write(data)
                self._stream.flush()
                return True
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False


def _stdout_fd() -> int:
    try:
        return sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return 1


class LineSplitter(asyncio.Protocol):
    """Reads a child's pipe; calls on_lines with the complete lines of each read (one call
    per read, not per line: a flood costs the loop little per line) and on_eof at the end.

    A partial last line is flushed at EOF so that nothing is lost at shutdown; an
    over-long line is cut into MAX_LINE pieces rather than held without bound.
    """

    def __init__(self, on_lines: Callable[[list[str]], None], on_eof: Callable[[], None]):
        self._buf = bytearray()
        self._on_lines = on_lines
        self._on_eof = on_eof

    def data_received(self, data: bytes) -> None:
        self._buf.extend(data)
        lines: list[str] = []
        nl = self._buf.rfind(b"\n")
        if nl >= 0:
            # "\n" never occurs inside a UTF-8 sequence: decoding the block at once is
            # decoding each line
            block = self._buf[:nl].decode("utf-8", "replace")
            del self._buf[:nl + 1]
            lines = [line.rstrip("\r") for line in block.split("\n")]
        while len(self._buf) >= MAX_LINE:
            lines.append(_text(bytes(self._buf[:MAX_LINE])))
            del self._buf[:MAX_LINE]
        if lines:
            self._on_lines(lines)

    def eof_received(self) -> bool:
        if self._buf:
            self._on_lines([_text(bytes(self._buf))])
            self._buf.clear()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_eof()


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\r").decode("utf-8", "replace")


class Tail:
    """The last lines a child printed, for error messages that say why it failed."""

    def __init__(self, n: int = 20):
        self._lines: collections.deque[str] = collections.deque(maxlen=n)

    def add(self, line: str) -> None:
        self._lines.append(line)

    def extend(self, lines: list[str]) -> None:
        self._lines.extend(lines[-(self._lines.maxlen or len(lines)):])

    def lines(self) -> list[str]:
        return list(self._lines)


class _SinkHandler(logging.Handler):
    def __init__(self, sink: LogSink):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.line(SUPERVISOR_TAG, f"{record.name}: {record.getMessage()}", record.levelname.lower())
        except Exception:  # noqa: BLE001 - logging must never raise into the loop
            pass


def route_logging(sink: LogSink) -> None:
    """Library warnings (asyncio's among them) become tagged lines like ours, never bare
    tracebacks on stderr. For the supervisor process only (it replaces the root handlers)."""
    root = logging.getLogger()
    root.handlers = [_SinkHandler(sink)]
    root.setLevel(logging.WARNING)
