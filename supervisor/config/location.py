"""Where a command finds things: which config file it reads (the same way for every
command, wherever it runs), and the control socket when the config names none.

``--config`` wins, then ``$ONECARD_CONFIG``, then the default that ships inside the
package (``supervisor/default.toml``, a copy of ``configs/default.toml``): nothing depends
on the current directory. Standard library only: `onecard status` uses it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGED_DEFAULT = Path(__file__).resolve().parent.parent / "default.toml"
ENV_VAR = "ONECARD_CONFIG"
DEFAULT_CONTROL_SOCKET = f"/tmp/onecard-{os.getuid()}/control.sock"


@dataclass(frozen=True)
class ConfigSource:
    path: str
    origin: str   # what chose it, named in error messages: "--config", "ONECARD_CONFIG", "built-in default"

    def describe(self) -> str:
        if self.origin == "--config":
            return f"--config {self.path}"
        if self.origin == ENV_VAR:
            return f"{ENV_VAR}={self.path}"
        return f"the built-in default config {self.path}"


def resolve(option: str | None, environ: Mapping[str, str] | None = None) -> ConfigSource:
    environ = os.environ if environ is None else environ
    if option:
        return ConfigSource(option, "--config")
    if environ.get(ENV_VAR):
        return ConfigSource(environ[ENV_VAR], ENV_VAR)
    return ConfigSource(str(PACKAGED_DEFAULT), "built-in default")
