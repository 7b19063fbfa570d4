"""Config files written for a test, and the one error message that loading one gives."""

from __future__ import annotations

import pytest

from supervisor.config.errors import ConfigError
from supervisor.config.loading import load_config

BASE = """
[supervisor]
grace_s = 5
[services.detect]
app = "services.detect.app:create_app"
port = 7862
[services.img2img]
app = "services.img2img.app:create_app"
port = 7861
"""

COMMAND_ONLY = """
[services.worker]
command = ["sleep", "1"]
port = 7870
"""


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(path, **kw) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(path, **kw)
    return str(ei.value)
