"""Which Redis errors are outages (retry later) and which are bugs.

redis-py raises an out-of-memory refusal, a replica that is read-only after a failover, a
primary that is down or a server busy with a script as ResponseError, the class it also uses
for a wrong Lua script; treating them all as bugs turned a full or failing-over Redis into
500s and dead-lettered jobs."""

from __future__ import annotations

from redis.exceptions import MasterDownError, OutOfMemoryError, ReadOnlyError, ResponseError, TryAgainError

_OUTAGE_CLASSES = (OutOfMemoryError, ReadOnlyError, MasterDownError, TryAgainError)
_OUTAGE_PREFIXES = ("OOM", "READONLY", "MASTERDOWN", "NOREPLICAS", "LOADING", "BUSY", "TRYAGAIN")


def is_full(exc: BaseException) -> bool:
    """Redis at its maxmemory under noeviction: reachable, but it takes nothing new."""
    return isinstance(exc, OutOfMemoryError) or "maxmemory" in str(exc)


def is_outage(exc: BaseException) -> bool:
    if not isinstance(exc, ResponseError):
        return False
    return isinstance(exc, _OUTAGE_CLASSES) or is_full(exc) or str(exc).lstrip("-").startswith(_OUTAGE_PREFIXES)


def refusal_reason(exc: BaseException | None) -> str | None:
    """Why Redis refuses a write, when it answered and refused: full, or a read-only replica."""
    if not isinstance(exc, ResponseError):
        return None
    if is_full(exc):
        return "maxmemory: Redis is full (noeviction)"
    if isinstance(exc, ReadOnlyError) or str(exc).startswith("READONLY"):
        return "read-only: a replica after a failover"
    if str(exc).startswith(("MASTERDOWN", "NOREPLICAS")):
        return "its primary is down"
    return None
