"""The onecard version: one constant, read by pyproject.toml (dynamic version) and by the
CLI and /metrics, so that nothing heavy (importlib.metadata) is imported to tell it."""

from __future__ import annotations

__version__ = "0.1.0"


def version() -> str:
    return __version__
