"""The Upgrade header, renamed before the parser sees it.

curl --http2 on an http:// URL offers h2c (``Connection: Upgrade, HTTP2-Settings`` and
``Upgrade: h2c``), even on a POST. No route takes an upgrade, and httptools takes one as the
end of the request: a POST's body was never read, and a valid request got a 400 (its picture
"empty"). Renamed ``X-Upgrade-Ignored``, the request is read and answered as the plain
HTTP/1.1 request it also is (RFC 9110 7.8: a server may ignore Upgrade). A header split
across two reads, or a CONNECT, still stops the parser: that request is answered and its
connection closed (protocol.py).
"""

from __future__ import annotations

import re

UPGRADE_HEADER = re.compile(rb"(?i)(?<=\n)upgrade[ \t]*:")


def without_upgrade(data: bytes) -> bytes:
    """`data` (the start of a request head, maybe with more after it) with any Upgrade header
    renamed."""
    end = data.find(b"\r\n\r\n")
    head = data if end < 0 else data[:end + 2]
    if UPGRADE_HEADER.search(head) is None:
        return data
    return UPGRADE_HEADER.sub(b"X-Upgrade-Ignored:", head) + (b"" if end < 0 else data[end + 2:])
