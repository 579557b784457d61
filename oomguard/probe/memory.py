"""The memory figures a probe record carries: host RSS, and the caching allocator's peaks per device.

CUDA figures are read only where the program initialized CUDA itself (``torch.cuda.is_initialized``):
the probe never creates a CUDA context, which costs hundreds of MiB of device memory.
"""

from __future__ import annotations

import os
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """Resident set size from /proc/self/statm (one small read; None off Linux)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


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
    """Per device this process allocated on: the allocator's peak allocated and reserved since the
    last reading (then reset, so the next reading is the next interval's), and the limit."""
    cuda = torch.cuda
    if not cuda.is_initialized():
        return {}
    peaks: dict[str, dict[str, int]] = {}
    for index in range(cuda.device_count()):
        reserved = int(cuda.max_memory_reserved(index))
        if not reserved:
            continue  # a device this process never allocated on (another rank's)
        allocated = int(cuda.max_memory_allocated(index))
        cuda.reset_peak_memory_stats(index)
        peaks[f"cuda:{index}"] = {"allocated_peak": allocated, "reserved_peak": reserved,
                                  "limit_bytes": limit_bytes(cuda, index)}
    return peaks
