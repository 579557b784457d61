"""What the memory chart needs: normalised samples, peak-keeping downsampling, and markers.

Pure functions over journal rows, so the tests feed them literal dicts. Sample rows have grown
over time (``rss``/``cgroup_usage`` from the core loop; ``worker_rss_bytes``, ``gpu_used_bytes``
and a per-device ``gpus`` list from the memory sampler); ``chart_point`` accepts every form.

Also here:

- Chart markers, kept current without rescanning the whole journal on every request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

from oomguard.supervisor.record.journal import Journal

MEMORY_KINDS = frozenset({"cuda_oom", "host_oom", "memory_limit"})


def _first(row: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return int(value)
    return None


def _gpus(row: dict[str, Any]) -> dict[str, int]:
    """GPU memory used per device index (as a string, so it is a JSON object key)."""
    devices = row.get("gpus")
    if isinstance(devices, list):
        out: dict[str, int] = {}
        for pos, dev in enumerate(devices):
            if isinstance(dev, dict):
                used = _first(dev, "worker_bytes", "used_bytes", "used")
                index = dev.get("cuda_index", dev.get("index", pos))
                if used is not None:
                    out[str(index)] = used
        return out
    used = _first(row, "gpu_worker_bytes", "gpu_used_bytes")
    return {} if used is None else {"0": used}


def chart_point(row: dict[str, Any]) -> dict[str, Any]:
    """One sample as the chart draws it: time, attempt, host RSS, cgroup usage, GPU per device."""
    return {
        "t": float(row["t"]),
        "attempt": row.get("attempt"),
        "host_rss": _first(row, "worker_rss_bytes", "rss"),
        "cgroup_usage": _first(row, "cgroup_usage_bytes", "cgroup_usage"),
        "gpu": _gpus(row),
    }


def _peak(point: dict[str, Any]) -> int:
    return max([point["host_rss"] or 0, *point["gpu"].values()])


def downsample(points: Sequence[dict[str, Any]], max_points: int) -> list[dict[str, Any]]:
    """At most ``max_points`` points, keeping each bucket's first, highest and last point.

    Striding (every n-th row) would drop exactly the spikes a person looks for before an OOM.
    Buckets never straddle attempts, so the last sample before each failure survives too.
    """
    if len(points) <= max_points:
        return list(points)
    width = max(1, -(-3 * len(points) // max_points))
    out: list[dict[str, Any]] = []
    start = 0
    while start < len(points):
        attempt = points[start]["attempt"]
        end = start + 1
        while end < min(start + width, len(points)) and points[end]["attempt"] == attempt:
            end += 1
        bucket = points[start:end]
        keep = {0, max(range(len(bucket)), key=lambda i: _peak(bucket[i])), len(bucket) - 1}
        out.extend(bucket[i] for i in sorted(keep))
        start = end
    if len(out) > max_points:  # many short attempts: thin evenly, but keep the newest point
        step = -(-len(out) // max_points)
        out = out[-1::-step][::-1]
    return out


def attempt_markers(attempts: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failures (OOMs apart), restarts and batch changes, from the attempts table."""
    markers: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for row in attempts:
        batch = f"{row['micro_batch']} × {row['grad_accum']}"
        if previous is not None:
            markers.append({"t": row["started"], "kind": "restart", "attempt": row["attempt"],
                            "label": f"attempt {row['attempt']} started at micro-batch {batch}"})
            if row["micro_batch"] != previous["micro_batch"]:
                markers.append({"t": row["started"], "kind": "batch", "attempt": row["attempt"],
                                "label": f"micro-batch {previous['micro_batch']} → {row['micro_batch']}"
                                         f" (accumulation {row['grad_accum']})"})
        if row.get("kind") and row.get("ended"):
            kind = "oom" if row["kind"] in MEMORY_KINDS else "failure"
            markers.append({"t": row["ended"], "kind": kind, "attempt": row["attempt"],
                            "label": f"{row['kind']} at micro-batch {row['micro_batch']}: "
                                     f"{row.get('evidence') or ''}"[:300]})
        previous = row
    return markers


def checkpoint_markers(checkpoints: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"t": c["first_seen"], "kind": "checkpoint", "attempt": c.get("attempt"),
             "label": f"checkpoint step {c['step']}" if c.get("step") is not None else "checkpoint"}
            for c in checkpoints if not c.get("bad")]


def event_marker(event: dict[str, Any]) -> dict[str, Any] | None:
    """A marker for a journal event the tables do not show: the worker changing its own batch."""
    if event["kind"] != "worker_batch":
        return None
    data = event["data"]
    return {"t": event["t"], "kind": "batch", "attempt": event.get("attempt"),
            "label": f"worker set micro-batch {data.get('micro_batch')} × {data.get('grad_accum')}"
                     f" ({data.get('reason', '')})"}


# Chart markers, kept current without rescanning the whole journal on every request.


PAGE = 1000
MAX_EVENT_MARKERS = 10_000


class MarkerScan:
    """Attempts and checkpoints are small tables, read each time; events can number millions
    (a progress record per step), so they are scanned once, incrementally, from the last id seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_id = 0
        self._from_events: list[dict[str, Any]] = []

    def markers(self, journal: Journal) -> list[dict[str, Any]]:
        out = attempt_markers(journal.attempts()) + checkpoint_markers(journal.checkpoints())
        out += self._scan(journal)
        return sorted(out, key=lambda m: m["t"])

    def _scan(self, journal: Journal) -> list[dict[str, Any]]:
        with self._lock:
            while events := journal.events(self._last_id, PAGE):
                self._last_id = events[-1]["id"]
                self._from_events += [m for e in events if (m := event_marker(e)) is not None]
            del self._from_events[:-MAX_EVENT_MARKERS]  # bounded: keep the newest
            return list(self._from_events)
