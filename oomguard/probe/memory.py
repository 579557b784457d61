"""The memory figures a probe record carries: host RSS, and the caching allocator's peaks per device.

Tested in tests/e2e/test_probe_compile.py (the allocator's peaks) and tests/e2e/test_probe.py.

CUDA figures are read only where the program initialized CUDA itself (``torch.cuda.is_initialized``):
the probe never creates a CUDA context, which costs hundreds of MiB of device memory.

What bounds a CPU process is the address space when it runs under ``RLIMIT_AS`` (an allocation fails
once its mapped size would pass the limit, whatever is resident), else its resident memory (a
cgroup's or the host's limit, which the supervisor knows): ``host_bound`` names the one that applies.
"""

from __future__ import annotations

import os
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


ADDRESS_SPACE, RSS, CUDA_ALLOCATED = "address_space", "rss", "cuda_allocated"  # the measures an oom record names


def statm() -> tuple[int, int] | None:
    """(mapped size, resident) in bytes from /proc/self/statm; None off Linux."""
    try:
        with open("/proc/self/statm", "rb") as f:
            size, resident = f.read().split()[:2]
        return int(size) * _PAGE, int(resident) * _PAGE
    except (OSError, ValueError):
        return None


def address_space_limit() -> int | None:
    """The soft ``RLIMIT_AS`` in bytes, or None when there is none."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return None
    return soft if soft > 0 and soft != resource.RLIM_INFINITY else None


def status_bytes(key: bytes) -> int | None:
    """One ``kB`` figure of /proc/self/status in bytes (``VmPeak:``, the highest mapped size)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def held(torch: Any) -> dict[str, int]:
    """What the process holds now in each measure an OOM may be judged in (before a step's forward)."""
    figures: dict[str, int] = {}
    cuda = torch.cuda
    if cuda.is_initialized():
        figures[CUDA_ALLOCATED] = int(cuda.memory_allocated())
    both = statm()
    if both is not None:
        figures[ADDRESS_SPACE], figures[RSS] = both
    return figures


def host_bound() -> tuple[str, int | None, int | None]:
    """(measure, what this process holds in it now, its limit) for a host OOM: the address space
    under ``RLIMIT_AS``, else the resident memory with no limit the process itself can see."""
    both = statm()
    limit = address_space_limit()
    if limit is not None:
        return ADDRESS_SPACE, both[0] if both else None, limit
    return RSS, both[1] if both else None, None


def fraction(cuda: Any, index: int) -> float | None:
    """The per-process memory fraction set on a device (``set_per_process_memory_fraction``), or
    None when none is set or this torch cannot tell (the getter came in torch 2.5)."""
    get = getattr(cuda, "get_per_process_memory_fraction", None)
    if get is None:
        return None
    value = float(get(index))
    return value if 0 < value < 1 else None


def limit_bytes(cuda: Any, index: int) -> int:
    """What this process may allocate on a device: the fraction's cap, else the device's total."""
    total = int(cuda.get_device_properties(index).total_memory)
    share = fraction(cuda, index)
    return int(total * share) if share is not None else total


def device_peaks(torch: Any) -> dict[str, dict[str, int]]:
    """Per device this process allocated on: the allocator's peak allocated and reserved as the
    allocator reports them (since the process started, or since the program's own
    ``reset_peak_memory_stats``), and the limit. Never reset here: the program's own
    ``max_memory_allocated()`` and ``memory_stats()`` must read what they would without the probe."""
    cuda = torch.cuda
    if not cuda.is_initialized():
        return {}
    peaks: dict[str, dict[str, int]] = {}
    for index in range(cuda.device_count()):
        reserved = int(cuda.max_memory_reserved(index))
        if not reserved:
            continue  # a device this process never allocated on (another rank's)
        peaks[f"cuda:{index}"] = {"allocated_peak": int(cuda.max_memory_allocated(index)), "reserved_peak": reserved,
                                  "limit_bytes": limit_bytes(cuda, index)}
    return peaks
