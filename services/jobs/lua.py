"""Lua scripts with named keys and arguments.

A script declares the names of its keys and arguments once; its body reads them as
``K.job`` and ``A.lease`` instead of ``KEYS[1]`` and ``ARGV[12]``, and the Python side
binds them by name (``Script.bind``), which refuses a missing or unknown name. Positional
arrays written by hand in two languages drifted apart once already.

Each script also says how it behaves when Redis is at its ``maxmemory`` (Redis 7 script
flags): the writes that move accepted jobs along (start, finish, retry, cancel) carry
``allow-oom``, so that a full Redis can never leave an accepted job in limbo; only a submit,
which adds new work, is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ALLOW_OOM, DENY_OOM, READ_ONLY = "allow-oom", "", "no-writes"


class Script:
    def __init__(self, name: str, keys: Iterable[str], args: Iterable[str], body: str, *,
                 flags: str = ALLOW_OOM, helpers: str = "", variadic: bool = False):
        self.name = name
        self.denies_oom = flags == DENY_OOM  # refused by a Redis at its maxmemory
        self.key_names = tuple(keys)
        self.arg_names = tuple(args)
        self.variadic = variadic  # more keys and arguments after the named ones (KEYS/ARGV beyond)
        for names in (self.key_names, self.arg_names):
            if len(set(names)) != len(names):
                raise ValueError(f"{name}: a name is declared twice")
        table = lambda var, names: "{" + ", ".join(f"{n} = {var}[{i + 1}]" for i, n in enumerate(names)) + "}"
        self.source = (f"#!lua flags={flags}\n" if flags else "#!lua\n") + \
            f"local K = {table('KEYS', self.key_names)}\nlocal A = {table('ARGV', self.arg_names)}\n" + helpers + body

    def bind(self, keys: dict[str, Any], args: dict[str, Any], extra_keys: Iterable[Any] = (),
             extra_args: Iterable[Any] = ()) -> tuple[list[Any], list[Any]]:
        """(KEYS, ARGV) in the declared order; every name must be given, and no other."""
        for what, given, names in (("key", keys, self.key_names), ("argument", args, self.arg_names)):
            missing, unknown = set(names) - set(given), set(given) - set(names)
            if missing or unknown:
                raise ValueError(f"{self.name}: {what}s missing {sorted(missing)}, unknown {sorted(unknown)}")
        extra_keys, extra_args = list(extra_keys), list(extra_args)
        if (extra_keys or extra_args) and not self.variadic:
            raise ValueError(f"{self.name} takes only its named keys and arguments")
        return ([keys[n] for n in self.key_names] + extra_keys,
                [_arg(args[n]) for n in self.arg_names] + [_arg(v) for v in extra_args])


def _arg(v: Any) -> Any:
    if isinstance(v, bool):
        return "1" if v else "0"
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return v
