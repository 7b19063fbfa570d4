"""Code of a service's own (its hooks, its model) run on a worker thread, where what it raises
is that request's failure and nothing more.

A hook that calls ``sys.exit()`` (a library's idea of error handling) or raises
``KeyboardInterrupt`` raised a BaseException that the executor hands back to the awaiting
task as it is: it went past every ``except Exception`` to uvicorn, the client got a plain-text
500, and the service exited with its batch neighbours' requests lost. Here it becomes a
HookExit (an Exception): that item's 500 in the envelope, its neighbours retried alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class HookExit(RuntimeError):
    """The service's code raised SystemExit, KeyboardInterrupt or another BaseException."""


def contained(fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        raise
    except BaseException as exc:  # noqa: BLE001 - on a worker thread, never the process's end
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise HookExit(f"{name} raised {type(exc).__name__}({exc!s:.200})") from exc  # (where it was called)
