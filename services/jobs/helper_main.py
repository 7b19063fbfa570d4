"""The jobs helper process (services.jobs.helper_pipe): frames in on stdin, frames out on
stdout, one call at a time, from a fixed table of functions; it ends when stdin closes.
Whatever else writes to stdout or reads stdin (a library's print) gets stderr and nothing."""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import asdict
from typing import Any


def _digest(data: bytes, args: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    from services.jobs.payload import Limits, digest_submit
    d = digest_submit(data, args["max_depth"], Limits(args["max_image_bytes"], args["max_pixels"]),
                      args.get("max_items"))
    fields = asdict(d)
    body = fields.pop("body")
    return fields, body


def _is_json(data: bytes, args: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    from services.jobs.consumer import is_json_document
    return {"is_json": is_json_document(data)}, b""


FUNCTIONS = {"digest": _digest, "is_json": _is_json}


def main() -> int:
    from services.jobs.helper_pipe import recv_frame, send_frame
    from services.runtime.device.threads import lower_priority
    # parsing a 30 MB submit is 100 ms of a core: it must not take it from the jobs event
    # loop (and its probes) when both want one, as a decode thread does not
    lower_priority()
    reads, writes = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    while True:
        try:
            head, data = recv_frame(reads)
        except EOFError:
            return 0
        try:
            result, out = FUNCTIONS[head["fn"]](data, head.get("args") or {})
            send_frame(writes, {"ok": True, "result": result}, out)
        except Exception:  # noqa: BLE001 - said to the parent, which raises it there
            send_frame(writes, {"ok": False, "error": traceback.format_exc(limit=5)[-2000:]})
        del data


if __name__ == "__main__":
    sys.exit(main())
