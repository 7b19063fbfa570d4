"""A fake NVML (pynvml's calls that supervisor/system/nvml.py makes): one or two cards,
chosen per-process memory, or no library at all. The integration twin is the stand-in
pynvml module in tests/children/fake_nvml/, imported by a real supervisor process."""

from __future__ import annotations

from types import SimpleNamespace


class FakeNvml:
    def __init__(self, procs=(), fail_init=False):
        self.procs = procs
        self.fail_init = fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise OSError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"gpu{i}"

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=30 * 2**30, total=(80 if h != "gpu1" else 16) * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=57)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in self.procs]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return []
