"""A fake pynvml at the NVML edge (the tests of observe/gpu.py, the sampler and the settling wait share it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from oomguard.supervisor.observe.gpu import GpuMonitor, PyNvml

GIB = 1024**3
UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-cccc3333-0000"]


@dataclass
class FakeDevice:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * GIB
    used: int = 10 * GIB
    util: int = 55
    mig: int = 0
    procs: list[tuple[int, int | None]] = field(default_factory=list)
    sm: list[tuple[int, int, int]] = field(default_factory=list)  # per-process samples: (pid, SM %, time in µs)
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code


class FakePynvml:
    """The functions oomguard calls, with pynvml's names; errors are real ``pynvml.NVMLError``s."""

    NVMLError = pynvml.NVMLError

    def __init__(self, devices: list[FakeDevice], init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.init_calls = 0
        for const in dir(pynvml):
            if const.startswith("NVML_ERROR_"):
                setattr(self, const, getattr(pynvml, const))

    def _dev(self, handle: int, fn: str) -> FakeDevice:
        device = self.devices[handle]
        if fn in device.errors:
            raise pynvml.NVMLError(device.errors[fn])
        return device

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return self._dev(handle, "name").name.encode()  # old bindings return bytes

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._dev(handle, "uuid").uuid

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        d = self._dev(handle, "memory")
        return SimpleNamespace(total=d.total, used=d.used, free=d.total - d.used)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=self._dev(handle, "util").util, memory=0)

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        return [self._dev(handle, "mig").mig, 0]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        d = self._dev(handle, "procs")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in d.procs]


    def nvmlDeviceGetProcessUtilization(self, handle: int, since: int) -> list[Any]:
        samples = [s for s in self._dev(handle, "sm").sm if s[2] > since]
        if not samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)  # what NVML says when none was sampled
        return [SimpleNamespace(pid=pid, smUtil=sm, memUtil=0, encUtil=0, decUtil=0, timeStamp=t)
                for pid, sm, t in samples]


def monitor(fake: FakePynvml, visible: str | None = None, **kw: Any) -> GpuMonitor:
    return GpuMonitor(PyNvml(fake), visible_devices=visible, **kw)

