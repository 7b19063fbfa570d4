"""Moved to common/hostmemory.py (the supervisor's plan reads it too); this name re-exports it
until services/ is restructured."""

from common.hostmemory import *  # noqa: F403 - the whole module, under its old name
