"""The Upgrade header, renamed before the parser sees it.

curl --http2 on an http:// URL offers h2c (``Connection: Upgrade, HTTP2-Settings`` and
``Upgrade: h2c``), even on a POST. No route takes an upgrade, and httptools takes one as the
end of the request: a POST's body was never read, and a valid request got a 400 (its picture
"empty"). Renamed ``X-Upgrd`` (as long as the name it replaces: the head's size, checked
against max_header_bytes, is the one the client sent), the request is read and answered as
the plain HTTP/1.1 request it also is (RFC 9110 7.8: a server may ignore Upgrade).

Only a head known whole is touched: one that begins the read (no request in progress) and
ends in it. Bytes after a head's end are a body, whatever they look like: renaming in them
changed what the app read, and the 10 bytes the first name added were parsed as a request of
their own. A head split across reads, one pipelined behind another in the same read, or a
CONNECT still stops the parser: that request is answered, then its connection closed
(protocol.py).
"""

from __future__ import annotations

import re

UPGRADE_NAME = re.compile(rb"(?i)(?<=\n)upgrade(?=[ \t]*:)")
RENAMED = b"X-Upgrd"


def without_upgrade(data: bytes) -> bytes:
    """`data`, a read that begins a request, with its head's Upgrade header renamed when the
    head ends in this read; else `data` as it is."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return data
    head = data[:end + 2]
    if UPGRADE_NAME.search(head) is None:
        return data
    return UPGRADE_NAME.sub(RENAMED, head) + data[end + 2:]
