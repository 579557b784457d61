"""Measuring a step's peak memory and the room left, on a CUDA device or on the host.

Growing back needs two numbers: how many bytes one more sample costs (the step's peak above
what was in use before it, divided by the micro-batch) and how many bytes are still available.
On CUDA they come from the caching allocator. On the host, the peak is the resident-set high
water mark (``VmHWM``), which Linux lets a process reset by writing ``5`` to
``/proc/self/clear_refs``; the room is the tightest of ``RLIMIT_AS``, the memory cgroup's limit
and ``MemAvailable``.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch


class MemoryProbe:
    """Peak-per-step and headroom for the device that trains (``cuda`` or ``cpu``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self._before = 0

    def start_step(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            _reset_rss_peak()
            self._before = _status_kib("VmRSS") * 1024

    def step_peak(self) -> int:
        """Peak bytes in use during the step just finished (absolute, not above baseline)."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return _status_kib("VmHWM") * 1024

    def bytes_above_start(self) -> int:
        return max(0, self.step_peak() - self._before)

    def headroom(self) -> int | None:
        """Bytes that may still be allocated before the next OOM, or None when unknown."""
        if self.cuda:
            return _cuda_headroom(self.device)
        return _host_headroom()

    def rss(self) -> int:
        return _status_kib("VmRSS") * 1024


def _cuda_headroom(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)
    room = free + reserved - allocated
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        room = min(room, int(total * fraction(device)) - allocated)
    return room


def _host_headroom() -> int | None:
    rooms: list[int] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        rooms.append(soft - _status_kib("VmSize") * 1024)
    cgroup = _cgroup_room()
    if cgroup is not None:
        rooms.append(cgroup)
    available = _meminfo_kib("MemAvailable")
    if available is not None:
        rooms.append(available * 1024)
    return min(rooms) if rooms else None


def _cgroup_room() -> int | None:
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        base = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        current = int((base / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None
    return None if limit == "max" else int(limit) - current


def _reset_rss_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or a kernel without the reset: the peak then only ever rises


def _status_kib(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass  # no procfs: report 0, which disables growing back on this host
    return 0


def _meminfo_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
