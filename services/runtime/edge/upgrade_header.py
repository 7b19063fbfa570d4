"""The Upgrade header, renamed before the parser sees it.

curl --http2 on an http:// URL offers h2c (``Connection: Upgrade, HTTP2-Settings`` and
``Upgrade: h2c``), even on a POST. No route takes an upgrade, and httptools takes one as the
end of the request: a POST's body was never read, and a valid request got a 400 (its picture
"empty"). Renamed ``X-Upgrd`` (as long as the name it replaces: the head's size, checked
against max_header_bytes, is the one the client sent), the request is read and answered as
the plain HTTP/1.1 request it also is (RFC 9110 7.8: a server may ignore Upgrade).

Only bytes known to be head are touched: a read that begins a request, up to its head's
end; or, while a head is unfinished, this read up to the head's end (its first CRLFCRLF: the
parser takes no bare CR or LF, so none comes earlier), unless that end was cut between the
reads (the previous read's last bytes and this one's first make it), when all of this read
is body. Bytes after a head's end are a body, whatever they look like: renamed in them,
the app read another picture, and the 10 bytes a longer name added were parsed as a request
of their own. A head pipelined behind another in the same read, or a CONNECT, still stops
the parser: that request is answered, then its connection closed (protocol.py).
"""

from __future__ import annotations

import re

UPGRADE_NAME = re.compile(rb"(?i)(?<=\n)upgrade(?=[ \t]*:)")
RENAMED = b"X-Upgrd"
END = b"\r\n\r\n"


def without_upgrade(data: bytes, before: bytes = b"\n") -> bytes:
    """`data` with the Upgrade header of the head it begins or goes on with renamed. `before`:
    the last bytes of the head read so far (a request's start: a line's end)."""
    if END in before[-3:] + data[:3]:
        return data  # the head ended between the reads: all of this is body
    end = data.find(END)
    head = data if end < 0 else data[:end + 2]
    joined = before[-1:] + head  # a name at the read's start, after the previous line's end
    if UPGRADE_NAME.search(joined) is None:
        return data
    return UPGRADE_NAME.sub(RENAMED, joined)[1:] + (b"" if end < 0 else data[end + 2:])
