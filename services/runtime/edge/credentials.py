"""Credentials a service may require: an API key, HTTP Basic pairs, or both.

The API key comes as ``Authorization: Bearer <key>`` or ``X-API-Key``; Basic pairs as
the AUTOMATIC1111 webui's ``--api-auth`` does (``user:password``, several separated by
commas), read from an environment variable or a file so that no password sits in the
config or is ever printed. Every comparison is constant-time, and a request carries one
credential: repeated credential headers are refused, not tried one by one. Failures are
counted and rate-limited per client address by services.runtime.edge.auth_failures.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from services.runtime.settings import ServiceSettings


def parse_pairs(text: str) -> list[tuple[bytes, bytes]]:
    pairs = []
    for chunk in text.replace("\n", ",").split(","):
        chunk = chunk.strip()
        if not chunk or chunk.startswith("#"):
            continue
        user, sep, password = chunk.partition(":")
        if not sep or not user:
            raise ValueError("expected user:password pairs separated by commas or new lines")
        pairs.append((user.encode(), password.encode()))
    return pairs


@dataclass
class Credentials:
    api_key: bytes | None = None
    basic: list[tuple[bytes, bytes]] = field(default_factory=list)

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> Credentials:
        key = settings.resolved_api_key()
        basic: list[tuple[bytes, bytes]] = []
        if settings.basic_auth_env:
            basic += parse_pairs(os.environ.get(settings.basic_auth_env, ""))
        if settings.basic_auth_file:
            basic += parse_pairs(Path(settings.basic_auth_file).read_text(encoding="utf-8"))
        return cls(key.encode() if key else None, basic)

    @property
    def required(self) -> bool:
        return self.api_key is not None or bool(self.basic)

    def check(self, scope) -> bool:
        """True for a request that presents exactly one credential, and a right one.

        Several credentials in one request (repeated ``X-API-Key`` or ``Authorization``
        headers, or one of each) are refused whatever they hold: trying each would let one
        request carry hundreds of guesses. A header holding several candidates (``a, b``,
        as a proxy joins repeated headers) is compared whole, so it is one wrong value."""
        presented = [(name, value) for name, value in scope.get("headers", ())
                     if name in (b"x-api-key", b"authorization")]
        if len(presented) != 1:
            return False
        name, value = presented[0]
        if name == b"x-api-key":
            return self.api_key is not None and hmac.compare_digest(value.strip(), self.api_key)
        scheme, _, rest = value.strip().partition(b" ")
        scheme = scheme.lower()
        if scheme == b"bearer" and self.api_key is not None:
            return hmac.compare_digest(rest.strip(), self.api_key)
        if scheme == b"basic" and self.basic:
            return self._basic(rest.strip())
        return False

    def _basic(self, token: bytes) -> bool:
        try:
            user, sep, password = base64.b64decode(token, validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        if not sep:
            return False
        found = False
        for u, p in self.basic:  # every pair, every time: no early exit to time
            found |= hmac.compare_digest(user, u) & hmac.compare_digest(password, p)
        return found

    def hint(self) -> str:
        ways = []
        if self.api_key is not None:
            ways.append("an API key (Authorization: Bearer or X-API-Key)")
        if self.basic:
            ways.append("HTTP Basic credentials")
        return "missing or wrong credentials: send " + " or ".join(ways)

    def challenge(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Basic realm="onecard"' if self.basic else "Bearer"}
