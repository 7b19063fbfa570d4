"""Errors the command line turns into exit codes; light, so that every module may raise them."""

from __future__ import annotations


class ConfigError(Exception):
    """A configuration problem; the message names the file or option, the key and what was expected."""

    exit_code = 2
