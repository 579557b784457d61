"""GPU memory through NVML: the one seam between oomguard and ``pynvml`` (nvidia-ml-py).

``GpuMonitor`` turns the few NVML calls of ``PyNvml`` (over the real module, or the fake one the
tests give it) into ``GpuReading`` figures for the devices the worker can see, the worker's own
processes' memory picked out. Nothing here raises for a missing GPU: why there are no figures is
decided once and said in one line (``GpuSnapshot.unavailable``), not once per sample.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import psutil

# pynvml maps "value not available" to None; older bindings pass the raw sentinel through.
_NOT_AVAILABLE = 2**64 - 1


class NvmlError(Exception):
    """An NVML failure, reduced to a short kind (a value of ``_KINDS``, or ``other``) and one line for a person."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class NvmlProcess:
    """One compute process as NVML reports it; ``used_bytes`` is None when NVML cannot tell."""

    pid: int
    used_bytes: int | None


_KINDS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "library_not_found",
    "NVML_ERROR_DRIVER_NOT_LOADED": "driver_not_loaded",
    "NVML_ERROR_NOT_SUPPORTED": "not_supported",
    "NVML_ERROR_NO_PERMISSION": "no_permission",
    "NVML_ERROR_GPU_IS_LOST": "gpu_lost",
    "NVML_ERROR_NOT_FOUND": "not_found",
}


class PyNvml:
    """The NVML calls oomguard uses, over the ``pynvml`` module (or a stand-in with the same names, for
    tests). Every method raises ``NvmlError`` on failure."""

    def __init__(self, lib: ModuleType | Any) -> None:
        self._lib = lib
        # Error codes differ between NVML versions only by name lookup, so resolve them once.
        self._kinds = {getattr(lib, const): kind for const, kind in _KINDS.items() if hasattr(lib, const)}

    def _call(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self._lib, fn)(*args)
        except self._lib.NVMLError as exc:
            kind = self._kinds.get(getattr(exc, "value", None), "other")
            raise NvmlError(kind, f"{fn}: {exc}") from exc

    def init(self) -> None:
        self._call("nvmlInit")

    def shutdown(self) -> None:
        self._call("nvmlShutdown")

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def handle(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    def name(self, handle: Any) -> str:
        return _text(self._call("nvmlDeviceGetName", handle))

    def uuid(self, handle: Any) -> str:
        return _text(self._call("nvmlDeviceGetUUID", handle))

    def memory(self, handle: Any) -> tuple[int, int, int]:
        """(total, used, free) in bytes."""
        info = self._call("nvmlDeviceGetMemoryInfo", handle)
        return int(info.total), int(info.used), int(info.free)

    def utilization(self, handle: Any) -> int:
        """GPU busy percent over the driver's last sample period."""
        return int(self._call("nvmlDeviceGetUtilizationRates", handle).gpu)

    def mig_enabled(self, handle: Any) -> bool:
        try:
            current, _pending = self._call("nvmlDeviceGetMigMode", handle)
        except NvmlError as exc:
            if exc.kind == "not_supported":  # pre-Ampere boards have no MIG at all
                return False
            raise
        return bool(current)

    def process_utilization(self, handle: Any, since_us: int) -> list[tuple[int, int, int]]:
        """(pid, SM %, µs) of each process NVML sampled after ``since_us``; empty when no kernel ran since."""
        if not hasattr(self._lib, "nvmlDeviceGetProcessUtilization"):  # bindings older than the call
            raise NvmlError("not_supported", "nvmlDeviceGetProcessUtilization: not in this pynvml")
        try:
            samples = self._call("nvmlDeviceGetProcessUtilization", handle, since_us)
        except NvmlError as exc:
            if exc.kind == "not_found":  # NVML's answer when no process was sampled since then
                return []
            raise
        return [(int(s.pid), int(s.smUtil), int(s.timeStamp)) for s in samples]

    def processes(self, handle: Any) -> list[NvmlProcess]:
        out = []
        for proc in self._call("nvmlDeviceGetComputeRunningProcesses", handle):
            used = getattr(proc, "usedGpuMemory", None)
            out.append(NvmlProcess(int(proc.pid), None if used in (None, _NOT_AVAILABLE) else int(used)))
        return out


def _text(value: str | bytes) -> str:
    # pynvml returned bytes before 11.x and str since; accept both.
    return value.decode() if isinstance(value, bytes) else value


class VisibleDevice(NamedTuple):
    """A device the worker can see: its CUDA ordinal, the NVML index it maps to, NVML's handle of it."""

    cuda_index: int
    nvml_index: int
    handle: Any
    uuid: str
    name: str


def parse_visible_devices(value: str | None, uuids: Sequence[str]) -> list[int]:
    """NVML indices named by ``CUDA_VISIBLE_DEVICES``, in CUDA order, by CUDA's rules: unset is all;
    indices or UUID prefixes; the list stops at the first entry that names no device (``""``, ``-1``).
    ``uuids``: every device's, by NVML index (NVML's PCI order is CUDA's on machines of identical GPUs)."""
    if value is None:
        return list(range(len(uuids)))
    chosen: list[int] = []
    for entry in (part.strip() for part in value.split(",")):
        index = _match_device(entry, uuids)
        if index is None or index in chosen:
            break
        chosen.append(index)
    return chosen


def _match_device(entry: str, uuids: Sequence[str]) -> int | None:
    if entry.isdigit():
        index = int(entry)
        return index if index < len(uuids) else None
    if not entry.startswith(("GPU-", "MIG-")):
        return None
    matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


@dataclass(frozen=True)
class GpuReading:
    """One visible device at one moment; ``worker_bytes``: what NVML attributes to the worker's process
    tree, or None with ``worker_note`` saying why (MIG, no per-process figures, another PID namespace)."""

    cuda_index: int
    nvml_index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    utilization_pct: int | None
    worker_bytes: int | None
    worker_pids: tuple[int, ...]
    worker_note: str | None = None
    # (pid, bytes) of each worker process on this device: one per rank under torchrun
    worker_processes: tuple[tuple[int, int | None], ...] = ()
    # the busiest worker process's SM share since the last reading (0 when none of them ran a
    # kernel); None where NVML gives no per-process utilization (then only the device's counts)
    worker_sm_pct: int | None = None

    @property
    def worker_or_used(self) -> int:
        """The worker's bytes on the device where NVML gives them, else the device's used bytes."""
        return self.worker_bytes if self.worker_bytes is not None else self.used_bytes


@dataclass(frozen=True)
class GpuSnapshot:
    """All visible devices; ``unavailable`` is the one-line reason when there are no figures."""

    devices: tuple[GpuReading, ...]
    unavailable: str | None = None


class GpuMonitor:
    """Reads the worker's visible GPUs (default: the CUDA_VISIBLE_DEVICES it inherits); NVML opened once, lazily."""

    _UNSET: Any = object()

    def __init__(self, nvml: PyNvml | None = None, visible_devices: str | None = _UNSET,
                 pid_exists: Callable[[int], bool] = psutil.pid_exists) -> None:
        self._nvml = nvml
        inherited = visible_devices is self._UNSET
        self._visible = os.environ.get("CUDA_VISIBLE_DEVICES") if inherited else visible_devices
        self._pid_exists = pid_exists
        self._devices: list[VisibleDevice] | None = None
        self._unavailable: str | None = None
        self._sm_seen: dict[int, int] = {}  # NVML index -> newest per-process sample time read (µs)
        self._sm_unsupported: set[int] = set()  # devices whose per-process utilization NVML refused

    def read(self, worker_pids: Collection[int] = ()) -> GpuSnapshot:
        """Figures for every visible device; never raises for NVML trouble."""
        if self._devices is None and self._unavailable is None:
            self._open()
        if self._devices is None:
            return GpuSnapshot((), self._unavailable)
        pids = frozenset(worker_pids)
        readings = []
        for device in self._devices:
            try:
                readings.append(self._read_one(device, pids))
            except NvmlError as exc:
                # A lost GPU must not kill the watch loop; the other devices still count.
                return GpuSnapshot(tuple(readings), f"GPU figures incomplete: {exc}")
        return GpuSnapshot(tuple(readings))

    def close(self) -> None:
        """Release NVML (safe to call when it never opened)."""
        if self._devices is not None and self._nvml is not None:
            try:
                self._nvml.shutdown()
            except NvmlError:
                pass  # shutting down a half-broken driver: nothing left to release
        self._devices = None

    def _open(self) -> None:
        if self._nvml is None:  # the real binding
            try:
                import pynvml
            except ImportError as exc:
                self._unavailable = f"GPU figures unavailable: the nvidia-ml-py package is not installed ({exc})"
                return
            self._nvml = PyNvml(pynvml)
        try:
            self._nvml.init()
            devices = self._enumerate(self._nvml)
        except NvmlError as exc:
            why = {"library_not_found": "NVML library not found (no NVIDIA driver installed)",
                   "driver_not_loaded": "the NVIDIA driver is not loaded",
                   "no_permission": f"no permission to query NVML ({exc})"}.get(exc.kind, str(exc))
            self._unavailable = f"GPU figures unavailable: {why}"
            return
        self._devices = devices
        if not devices:
            self.close()  # nothing to watch: release NVML now rather than at exit
            self._unavailable = f"GPU figures unavailable: CUDA_VISIBLE_DEVICES={self._visible!r} hides every GPU"

    def _enumerate(self, nvml: PyNvml) -> list[VisibleDevice]:
        handles = [nvml.handle(i) for i in range(nvml.device_count())]
        uuids = [nvml.uuid(h) for h in handles]
        chosen = parse_visible_devices(self._visible, uuids)
        return [VisibleDevice(cuda, index, handles[index], uuids[index], nvml.name(handles[index]))
                for cuda, index in enumerate(chosen)]

    def _read_one(self, device: VisibleDevice, pids: frozenset[int]) -> GpuReading:
        assert self._nvml is not None
        cuda, index, handle, uuid, name = device
        total, used, free = self._nvml.memory(handle)
        worker_bytes, mine, note = self._worker_usage(handle, pids)
        return GpuReading(cuda, index, uuid, name, total, used, free,
                          self._optional(self._nvml.utilization, handle), worker_bytes, tuple(p.pid for p in mine),
                          note, tuple((p.pid, p.used_bytes) for p in mine), self._worker_sm(index, handle, pids))

    def _worker_sm(self, index: int, handle: Any, pids: frozenset[int]) -> int | None:
        """The highest SM share of a worker process sampled since the last call; None where NVML
        has no per-process utilization for this device (asked once: it does not start to)."""
        assert self._nvml is not None
        if index in self._sm_unsupported or not pids:
            return None
        try:
            samples = self._nvml.process_utilization(handle, self._sm_seen.get(index, 0))
        except NvmlError as exc:
            if exc.kind in ("not_supported", "no_permission"):
                self._sm_unsupported.add(index)  # MIG, vGPU, old boards: the device's utilization stands in
            return None
        if samples:
            self._sm_seen[index] = max(t for _, _, t in samples)
        return max((sm for pid, sm, _ in samples if pid in pids), default=0)

    def _optional(self, call: Callable[[Any], int], handle: Any) -> int | None:
        try:
            return call(handle)
        except NvmlError as exc:
            if exc.kind in ("not_supported", "no_permission"):
                return None
            raise

    def _worker_usage(self, handle: Any, pids: frozenset[int]) -> tuple[int | None, list[NvmlProcess], str | None]:
        """(bytes used by the worker's processes, those processes, why bytes is None)."""
        assert self._nvml is not None
        if self._nvml.mig_enabled(handle):
            # On a MIG parent NVML lists no per-process memory to unprivileged callers.
            return None, [], "MIG mode: no per-process GPU memory; using the device's figures"
        try:
            procs = self._nvml.processes(handle)
        except NvmlError as exc:
            if exc.kind in ("not_supported", "no_permission"):
                return None, [], f"per-process GPU memory unavailable ({exc}); using the device's figures"
            raise
        mine = [p for p in procs if p.pid in pids]
        if mine and any(p.used_bytes is None for p in mine):
            return None, mine, "NVML reports no per-process memory on this driver"
        if not mine and pids and any(not self._pid_exists(p.pid) for p in procs):
            # NVML speaks host PIDs; inside a container without the host PID namespace they match nothing.
            return None, [], "GPU processes carry PIDs from another namespace (container without host PIDs)"
        return sum(p.used_bytes or 0 for p in mine), mine, None
