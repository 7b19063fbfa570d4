"""The supervisor's and the GPU's settings: plain dataclasses, declared once.

The command line validates them inside the whole config (pydantic reads the bounds
written here with annotated_types: config/schema.py); the long-running supervisor
process gets the same classes, typed, from the JSON the command line hands over
(cli/supervise.py), without importing pydantic. A new key is one line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le

from supervisor.config.location import DEFAULT_CONTROL_SOCKET

# What pydantic applies when it validates these inside Config: an unknown key is an error,
# and the defaults are checked like any value.
STRICT = {"extra": "forbid", "validate_default": True}


@dataclass
class SupervisorSettings:
    __pydantic_config__ = STRICT

    grace_s: Annotated[float, Gt(0), Le(3600)] = 10.0            # SIGTERM to SIGKILL wait
    # each service's own graceful drain timeout, below grace_s (default: grace_s minus
    # min(2 s, grace_s / 2))
    drain_s: Annotated[float, Gt(0), Le(3600)] | None = None
    startup_timeout_s: Annotated[float, Gt(0)] = 300.0           # time for every service to become ready
    readiness_period_s: Annotated[float, Gt(0), Le(60)] = 0.2    # /readyz poll period during start-up
    liveness_period_s: Annotated[float, Gt(0), Le(3600)] = 5.0   # /healthz probe period once ready
    liveness_timeout_s: Annotated[float, Gt(0), Le(600)] = 2.0   # one probe's time limit
    liveness_failures: Annotated[int, Ge(1), Le(1000)] = 3       # misses in a row that count as death
    # bind address of the probe port: "" is every interface, IPv4 and IPv6 (the pod IP
    # whichever family the cluster uses)
    health_host: str = ""
    health_port: Annotated[int, Ge(0), Le(65535)] = 7860         # probe port; 0 disables it
    # probe-port connections open at once; past it the longest-idle one is closed to make room
    health_max_clients: Annotated[int, Ge(1), Le(65536)] = 512
    # time a probe-port client has to send its whole request (408 or closed after it)
    health_idle_timeout_s: Annotated[float, Gt(0), Le(60)] = 1.0
    control_socket: str = DEFAULT_CONTROL_SOCKET                  # unix socket for `onecard status`
    # control-socket connections open at once; past it the longest-idle one is closed to make room
    control_max_clients: Annotated[int, Ge(1), Le(65536)] = 1024
    control_idle_timeout_s: Annotated[float, Gt(0), Le(60)] = 1.0  # time a control client has to send its command
    # how everything a service starts is kept and ended with it: a cgroup per service (v2,
    # else v1), else its process tree and environment marker; auto takes the first that works
    containment: Literal["auto", "cgroup2", "cgroup1", "process"] = "auto"
    # the supervisor's private directory (0700): probe sockets, MPS pipes (default: the
    # control socket's path + '.d')
    run_dir: str | None = None
    sample_period_s: Annotated[float, Gt(0), Le(3600)] = 5.0     # CPU, memory and GPU sampling (a worker thread)
    # lines held for a slow stdout before new ones are dropped (and counted)
    log_buffer_lines: Annotated[int, Ge(100), Le(10_000_000)] = 10000
    log_format: Literal["text", "json"] = "text"


@dataclass
class GpuSettings:
    __pydantic_config__ = STRICT

    visible_devices: str = "0"                                    # CUDA_VISIBLE_DEVICES given to every service
    mps: bool = False                                             # run services under the NVIDIA MPS control daemon
    mps_dir: str | None = None       # MPS pipe and log directories go here (default: in the run directory)
    mps_start_timeout_s: Annotated[float, Gt(0), Le(300)] = 10.0  # wait for the MPS daemon's control pipe
    mps_stop_timeout_s: Annotated[float, Gt(0), Le(300)] = 10.0   # wait for the MPS daemon to quit before SIGKILL
