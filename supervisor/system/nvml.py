"""GPU facts from NVML (nvidia-ml-py, imported as pynvml): device, memory, utilization,
and per-service memory.

Inside a container NVML reports host PIDs, which match none of ours; then the figure a
service reports for itself (torch's reserved memory, the onnxruntime arena) is used,
and the source of every figure is said. No GPU, no driver or no library gives a clean
"no GPU" state with its reason, never a traceback.
"""

from __future__ import annotations

import time
from typing import Any


class GpuFacts:
    RETRY_S = 60.0  # a missing driver does not appear by itself; do not retry every call

    def __init__(self, device: str = "0", nvml: Any = None):
        self.device = device.split(",")[0].strip() or "0"
        self._nvml = nvml
        self._handle = None
        self._failed_at: float | None = None
        self.reason = ""

    def _open(self):
        if self._handle is not None:
            return self._handle
        if self._failed_at is not None and time.monotonic() - self._failed_at < self.RETRY_S:
            return None
        try:
            nvml = self._nvml
            if nvml is None:
                import pynvml as nvml
                self._nvml = nvml
            nvml.nvmlInit()
            if self.device.isdigit():
                self._handle = nvml.nvmlDeviceGetHandleByIndex(int(self.device))
            else:
                self._handle = nvml.nvmlDeviceGetHandleByUUID(self.device)
            return self._handle
        except Exception as exc:  # noqa: BLE001 - NVMLError, OSError, ImportError: all mean "no GPU"
            self._failed_at = time.monotonic()
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}".rstrip(": ")
            return None

    def total_bytes(self) -> int | None:
        handle = self._open()
        if handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total)
        except Exception:  # noqa: BLE001 - any NVML failure: the total is unknown, not an error
            return None

    def read(self, pids_by_service: dict[str, set[int]] | None = None) -> dict[str, Any]:
        handle = self._open()
        if handle is None:
            return {"available": False, "reason": self.reason or "no GPU"}
        nvml = self._nvml
        try:
            name = nvml.nvmlDeviceGetName(handle)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:  # noqa: BLE001 - not supported on every device (MIG)
                util = None
            per_pid: dict[int, int] = {}
            for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    for p in getattr(nvml, getter)(handle):
                        used = p.usedGpuMemory
                        if used is not None:
                            per_pid[int(p.pid)] = per_pid.get(int(p.pid), 0) + int(used)
                except Exception:  # noqa: BLE001 - one kind of process list unsupported: use the other
                    continue
        except Exception as exc:  # noqa: BLE001 - the device went away under us
            self._handle = None
            self._failed_at = time.monotonic()
            self.reason = f"NVML error: {exc}"
            return {"available": False, "reason": self.reason}
        per_service = {}
        for service, pids in (pids_by_service or {}).items():
            hits = [per_pid[p] for p in pids if p in per_pid]
            if hits:
                per_service[service] = sum(hits)
        return {
            "available": True,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "memory_used_bytes": int(mem.used),
            "memory_total_bytes": int(mem.total),
            "utilization_percent": util,
            "per_service_bytes": per_service,
            "processes_seen": len(per_pid),
        }
