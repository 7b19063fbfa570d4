"""Probing a child: a GET (common/http1.py) over its unix probe socket or TCP port, and the
check that the answer comes from that child and not from whatever holds its port.

Identity, in order (documented in docs/operating.md):
1. the answer names an instance (``X-Onecard-Instance`` header or ``"instance"`` in the
   JSON body): it must be the token this spawn got in ``ONECARD_INSTANCE_TOKEN``;
2. else a ``"pid"`` in the JSON body must be a process of the child's tree;
3. else (a ``command`` service that knows nothing of onecard) the port's listening socket
   must belong to a process of the child's tree (psutil, in a worker thread, at every
   answer); an answer on the unix probe socket, which lives in the supervisor's private
   0700 directory, needs no more.
An answer that fails the check counts as no answer: not ready, and a liveness miss.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from common import http1
from supervisor.driver.child import ChildProcess
from supervisor.system import process_tree

MAX_BODY = 256 * 1024
STATS_MAX_BODY = 64 * 1024
INSTANCE_HEADER = "x-onecard-instance"


@dataclass(frozen=True)
class ProbeTarget:
    host: str
    port: int
    unix: str | None = None   # the runtime's probe socket, tried first

    def describe(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ProbeResult:
    status: int | None      # None: no HTTP answer (refused, timed out, garbled, not ours)
    body: bytes = b""
    error: str = ""
    instance: str | None = None
    via: str = ""           # "unix" or "tcp"
    foreign: bool = False   # answered, but not by our child

    @property
    def ok(self) -> bool:
        return self.status == 200

    def doc(self) -> dict:
        try:
            doc = json.loads(self.body)
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str,
                    max_body: int, via: str) -> ProbeResult:
    try:
        answer = await http1.get(reader, writer, path, host=host, max_body=max_body)
    except http1.BadStatusLine as exc:
        return ProbeResult(None, error=str(exc), via=via)
    except http1.BodyTooLarge as exc:
        return ProbeResult(None, error=f"{path} answered {exc.length} bytes, over the {max_body} read", via=via)
    return ProbeResult(answer.status, answer.body, instance=answer.headers.get(INSTANCE_HEADER), via=via)


async def _get(target: ProbeTarget, path: str, max_body: int) -> ProbeResult:
    limit = max_body + 16384  # the stream's buffer: the whole head must fit
    if target.unix:
        try:
            reader, writer = await asyncio.open_unix_connection(target.unix, limit=limit)
        except (FileNotFoundError, ConnectionRefusedError):
            pass  # not listening (yet): a service that does not serve the probe socket answers on TCP
        else:
            return await _exchange(reader, writer, "localhost", path, max_body, "unix")
    reader, writer = await asyncio.open_connection(target.host, target.port, limit=limit)
    return await _exchange(reader, writer, f"{target.host}:{target.port}", path, max_body, "tcp")


async def http_get(target: ProbeTarget, path: str, timeout: float, max_body: int = MAX_BODY) -> ProbeResult:
    try:
        return await asyncio.wait_for(_get(target, path, max_body), timeout)
    except TimeoutError:
        return ProbeResult(None, error=f"no answer within {timeout:g} s")
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        return ProbeResult(None, error=f"{type(exc).__name__}: {exc}")


Prober = Callable[[ProbeTarget, str, float, int], Awaitable[ProbeResult]]


def target_of(child: ChildProcess) -> ProbeTarget:
    return ProbeTarget(child.plan.host, child.plan.port, child.plan.probe_socket)


class ChildProber:
    """Probes a child and keeps only the answers that are its own. The process-table
    lookups run in worker threads (`tree_pids`, `listener_pids` are injectable)."""

    def __init__(self, prober: Prober = http_get,
                 tree_pids: Callable[[int], set[int]] | None = None,
                 listener_pids: Callable[[int, set[int]], set[int]] | None = None):
        self.prober = prober
        self.tree_pids = tree_pids or process_tree.tree_pids
        self.listener_pids = listener_pids or process_tree.listening_pids

    async def get(self, child: ChildProcess, path: str, timeout: float) -> ProbeResult:
        max_body = STATS_MAX_BODY if path == "/stats" else MAX_BODY
        target = target_of(child)
        r = await self.prober(target, path, timeout, max_body)
        if r.status is None:
            return r
        why = await self._not_ours(child, r)
        if why is None:
            return r
        return replace(r, status=None, foreign=True,
                       error=f"{path} on {target.describe()} was answered by another process, not {child.name} "
                             f"(pid {child.pid}): {why}")

    async def _not_ours(self, child: ChildProcess, r: ProbeResult) -> str | None:
        doc = r.doc()
        claimed = r.instance if r.instance is not None else doc.get("instance")
        if claimed is not None:
            if child.token and hmac.compare_digest(str(claimed).encode(), child.token.encode()):
                return None
            return "its instance token is not the one this service was started with"
        if child.pid is None:
            return "the service is not running"
        pid = doc.get("pid")
        if isinstance(pid, int) and not isinstance(pid, bool):
            pids = await asyncio.to_thread(self.tree_pids, child.pid)
            return None if pid in pids else f"it says pid {pid}, which is not in the service's process tree"
        if r.via == "unix":
            return None
        # Every answer, not once per spawn: the server may die and another process take
        # the port while the service's main process lives on (a wrapper).
        if await asyncio.to_thread(self._listens, child.pid, child.plan.port):
            return None
        return f"no process of the service's tree listens on port {child.plan.port}"

    def _listens(self, pid: int, port: int) -> bool:
        return bool(self.listener_pids(port, self.tree_pids(pid)))
