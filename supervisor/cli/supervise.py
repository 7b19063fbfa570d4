"""The long-running supervisor process (exec'd by handover.py): reads the plan, supervises,
exits with the unit's code. Imports no pydantic, no typer, no ML library: its settings
are the same dataclasses the command line validated (config/settings.py), rebuilt typed
from the JSON the command line wrote.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from supervisor.config.settings import GpuSettings, SupervisorSettings
from supervisor.policy.plan import Plan


def supervise(settings: SupervisorSettings, gpu: GpuSettings, plan: Plan) -> int:
    """Run the unit to its end in this process; the unit's exit code."""
    from supervisor.driver.logs import LogSink, route_logging
    from supervisor.driver.supervisor import Supervisor
    sup = Supervisor(settings, gpu, plan, log=LogSink(settings.log_format, max_lines=settings.log_buffer_lines))
    route_logging(sup.log)
    return asyncio.run(sup.run())


def main(fd: int) -> None:
    with os.fdopen(fd, "rb") as fh:
        doc = json.load(fh)
    code = supervise(SupervisorSettings(**doc["supervisor"]), GpuSettings(**doc["gpu"]), Plan.from_json(doc["plan"]))
    # stdout may be a pipe nobody reads: never wait on it at interpreter exit
    os._exit(code)


if __name__ == "__main__":
    main(int(sys.argv[1]))
