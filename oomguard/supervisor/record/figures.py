"""How status and the report state a run's progress and memory: one wording for both.

Tested in tests/unit/supervisor/observe/test_progress.py.

The progress comes from the journal's ``progress`` meta (``observe.progress``): with the in-process
probe, real optimizer steps, steps per second (timed inside the worker), the ETA where a total is
known, the allocator's peak and its limit; without it, the worker library's records or the steps
read from the output. Each attempt's peaks come from its journal row: the allocator's highest
per-step peak (``peak_allocated``, the probe's), NVML's GPU figure and the worker tree's RSS.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from oomguard.supervisor.units import format_size


def progress_text(progress: dict[str, Any]) -> str:
    """``step 120/1000, 3.2 steps/s, ETA 5 min; allocated peak 1.2 GiB of 24.0 GiB (at 14:02:11)``."""
    total = progress.get("total_steps")
    text = f"step {progress.get('step')}" + (f"/{total}" if total else "")
    if progress.get("steps_per_s"):
        text += f", {progress['steps_per_s']:.3g} steps/s"
    if progress.get("eta_s") is not None:
        text += f", ETA {progress['eta_s'] / 60:.0f} min"
    if progress.get("allocated_peak"):
        text += f"; allocated peak {format_size(progress['allocated_peak'])}"
        if progress.get("limit_bytes"):
            text += f" of {format_size(progress['limit_bytes'])}"
    if progress.get("source") == "probe":
        text += " [probe]"
    elif progress.get("source") == "resume_point":  # a new attempt before its first step
        text += " [resumed from its checkpoint]"
    if progress.get("t"):
        text += f" (at {time.strftime('%H:%M:%S', time.localtime(progress['t']))})"
    return text


def attempt_peaks(attempts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each attempt's micro-batch and peaks: the allocator's (probe), the GPU's (NVML), the RSS."""
    return [{"attempt": a["attempt"], "micro_batch": a["micro_batch"], "peak_allocated": a.get("peak_allocated"),
             "peak_gpu": a.get("peak_gpu"), "peak_rss": a.get("peak_rss")} for a in attempts]


def peak_text(peak: dict[str, Any]) -> str:
    """``attempt 2 at micro-batch 8: allocated peak 1.2 GiB, GPU 1.9 GiB, RSS 412.0 MiB``."""
    parts = [f"{label} {format_size(peak[key])}" for key, label in
             (("peak_allocated", "allocated peak"), ("peak_gpu", "GPU"), ("peak_rss", "RSS")) if peak.get(key)]
    return f"attempt {peak['attempt']} at micro-batch {peak['micro_batch']}: " + (", ".join(parts) or "no reading")
