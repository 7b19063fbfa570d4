"""What follows from a valid config: the run directory, each service's probe socket and
drain timeout, what the orchestrator must wait, the GPU budgets as shares of the card.

No pydantic here (the config's type is only named for the reader): the plan and the
long-running supervisor process use these.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.config.schema import Config


# AF_UNIX paths: 108 bytes with the terminating NUL.
UNIX_PATH_MAX = 107
# Seconds between a service's own drain timeout and the supervisor's SIGKILL, by default:
# room for the service's shutdown (lifespan, freeing the GPU) after its drain ends.
DRAIN_MARGIN_S = 2.0
# What `onecard run` needs after the services are gone: MPS quit (when on), the last log lines.
FLUSH_MARGIN_S = 3.0

UNIT_MEMORY_SHARE = 0.9  # of the unit's memory limit, for its services; the rest: supervisor, sentinel, kernel


def run_dir_of(config: Config) -> str:
    """The supervisor's private directory: created 0700 by the supervisor, never a directory
    it did not create (pointing control_socket at /run/onecard.sock leaves /run alone)."""
    return config.supervisor.run_dir or config.supervisor.control_socket + ".d"


def probe_socket_of(config: Config, name: str) -> str:
    return os.path.join(run_dir_of(config), "probes", f"{name}.sock")


def drain_of(config: Config, name: str | None = None) -> float:
    """A service's own graceful drain timeout: strictly below grace_s, so that a drain that
    runs out ends with the service exiting on its own, not with our SIGKILL."""
    svc = config.services.get(name)  # None (no name) is no service's name
    if svc is not None and svc.drain_s is not None:
        return svc.drain_s
    settings = config.supervisor
    if settings.drain_s is not None:
        return settings.drain_s
    return settings.grace_s - min(DRAIN_MARGIN_S, settings.grace_s / 2)


def termination_grace_min(config: Config) -> float:
    """The least the orchestrator must wait after SIGTERM before its SIGKILL (Kubernetes
    terminationGracePeriodSeconds, docker stop --time): the services' grace, the MPS
    daemon's quit, the last log lines."""
    extra = config.gpu.mps_stop_timeout_s if config.gpu.mps else 0.0
    return config.supervisor.grace_s + extra + FLUSH_MARGIN_S


def budget_fractions(config: Config, total_bytes: int | None) -> dict[str, float | None]:
    """Each service's GPU memory budget as a share of the card (None: no budget, or bytes
    that cannot be converted without knowing the card)."""
    out: dict[str, float | None] = {}
    for name, svc in config.enabled_services().items():
        if svc.gpu_memory_fraction is not None:
            out[name] = svc.gpu_memory_fraction
        elif svc.gpu_memory_bytes is not None and total_bytes:
            out[name] = svc.gpu_memory_bytes / total_bytes
        else:
            out[name] = None
    return out
