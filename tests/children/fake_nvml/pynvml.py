"""Stand-in for nvidia-ml-py, put first on PYTHONPATH of a process under test, so that
tests inject the GPU situation instead of assuming the host's (a GPU host has a real NVML).

FAKE_NVML=absent      nvmlInit raises NVMLError_LibraryNotFound, as without a driver
FAKE_NVML=16,80       two cards of 16 and 80 GiB (indices 0 and 1), 1 GiB used on each
"""
import os
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    def __str__(self):
        return "NVML Shared Library Not Found"


def _cards():
    spec = os.environ.get("FAKE_NVML", "absent")
    if spec == "absent":
        raise NVMLError_LibraryNotFound()
    return [int(x) * 2**30 for x in spec.split(",")]


def nvmlInit():
    _cards()


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return len(_cards())


def nvmlDeviceGetHandleByIndex(i):
    cards = _cards()
    if i >= len(cards):
        raise NVMLError(f"Invalid Argument: no device {i}")
    return i


def nvmlDeviceGetHandleByUUID(uuid):
    raise NVMLError("Not Found")


def nvmlDeviceGetName(h):
    return f"Fake GPU {h}"


def nvmlDeviceGetMemoryInfo(h):
    return SimpleNamespace(total=_cards()[h], used=2**30, free=_cards()[h] - 2**30)


def nvmlDeviceGetUtilizationRates(h):
    return SimpleNamespace(gpu=12, memory=3)


def nvmlDeviceGetComputeRunningProcesses(h):
    return []


def nvmlDeviceGetGraphicsRunningProcesses(h):
    return []
