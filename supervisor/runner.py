"""The long-running supervisor process (exec'd by launch.py): reads the plan, supervises,
exits with the unit's code. Imports no pydantic, no typer, no ML library."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from types import SimpleNamespace


def main(fd: int) -> None:
    with os.fdopen(fd, "rb") as fh:
        doc = json.load(fh)
    from supervisor.logs import LogSink
    from supervisor.plan import Plan
    from supervisor.unit import Supervisor
    from supervisor.logs import route_logging
    config = SimpleNamespace(supervisor=SimpleNamespace(**doc["supervisor"]), gpu=SimpleNamespace(**doc["gpu"]))
    sup = Supervisor(config, Plan.from_json(doc["plan"]),
                     log=LogSink(config.supervisor.log_format, max_lines=config.supervisor.log_buffer_lines))
    route_logging(sup.log)
    code = asyncio.run(sup.run())
    # stdout may be a pipe nobody reads: never wait on it at interpreter exit
    os._exit(code)


if __name__ == "__main__":
    main(int(sys.argv[1]))
