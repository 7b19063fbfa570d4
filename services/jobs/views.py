"""A listing page of GET /v1/jobs as bytes, with the finished jobs' views kept encoded.

A 500-job page was 2 ms of `public_view` and 2 ms of JSON encoding, all of it holding the
GIL: 16 clients reading such pages kept the jobs /healthz p99 at 75-87 ms. A finished job's
view does not change (a redrive makes it queued again), so its encoded form is kept, keyed by
every field the view reads: whatever changes a field makes a new key, never a stale view.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from services.jobs.records import TERMINAL, public_view

# every field public_view reads: the key of a kept view
VIEW_FIELDS = ("id", "state", "service", "route", "model", "priority", "attempts", "runs", "progress", "node",
               "error", "last_error", "dead", "cancel", "created_at", "started_at", "finished_at", "retry_at")
KEPT_VIEW_BYTES = 16 * 1024   # a view bigger than this (a long error message) is encoded each time


def encode(doc: Any) -> bytes:
    """As Starlette's JSONResponse renders: the same bytes whether kept or not."""
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


class EncodedViews:
    """Finished jobs' encoded views, the oldest dropped past `max_bytes` (keys and views)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._views: dict[tuple, bytes] = {}
        self._lock = threading.Lock()   # pages are made on several CPU-pool threads

    def view(self, fields: dict[str, str]) -> bytes:
        if fields.get("state") not in TERMINAL:
            return encode(public_view(fields))
        key = tuple(map(fields.get, VIEW_FIELDS))
        kept = self._views.get(key)
        if kept is not None:
            return kept
        data = encode(public_view(fields))
        if len(data) <= KEPT_VIEW_BYTES:
            self._keep(key, data)
        return data

    def _keep(self, key: tuple, data: bytes) -> None:
        cost = _cost(key, data)
        with self._lock:
            if key in self._views:
                return
            self._views[key] = data
            self.bytes += cost
            while self.bytes > self.max_bytes and self._views:
                old = next(iter(self._views))
                self.bytes -= _cost(old, self._views.pop(old))

    def __len__(self) -> int:
        return len(self._views)

    def page(self, model: str, state: str | None, jobs: list[dict[str, str]], nxt: str | None) -> bytes:
        """The page's JSON: {"model", "state", "jobs": [views], "next_cursor"}, as one encode of
        the whole would give."""
        views = b",".join([self.view(f) for f in jobs])
        return b"".join((b'{"model":', encode(model), b',"state":', encode(state), b',"jobs":[', views,
                         b'],"next_cursor":', encode(nxt), b"}"))


def _cost(key: tuple, data: bytes) -> int:
    """About what a kept view holds: its bytes, its key's strings and the entry itself."""
    return len(data) + sum(len(v) + 49 for v in key if v) + 64 + 8 * len(key)
