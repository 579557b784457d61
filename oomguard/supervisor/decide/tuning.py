"""Learning what fits: the loop's bookkeeping around the pure memory model (memmodel.py).

Each attempt becomes a ``Point`` (its micro-batch, the peak it reached, whether memory failed).
From the points the model proposes where to shrink after an OOM, whether ``--grow`` may try a
larger micro-batch, and, through the fit store, where a new run of the same job should start.

Where the in-process probe reports the allocator's per-step peaks, a point's peak is the highest of
them (what the model allocated at that micro-batch), not NVML's reserved view (which adds the CUDA
context and the allocator's cache, and misses peaks between two samples); and the limit the probe
reports (a per-process memory fraction's cap, else the device) is the capacity the model fits under.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from oomguard.supervisor.decide.fitstore import FitStore, JobKey
from oomguard.supervisor.decide.memmodel import Point, Prediction, fit, propose_growth, shrink_after_oom
from oomguard.supervisor.observe.allocator import AllocatorReport
from oomguard.supervisor.observe.memory import AttemptPeak, MemorySample

MEMORY_KINDS = ("cuda_oom", "host_oom", "memory_limit")


@dataclass
class SizeTuner:
    per_process_batch: int
    min_micro: int
    margin: float
    memory_limit: int | None = None
    store: FitStore | None = None
    key: JobKey | None = None
    points: list[Point] = field(default_factory=list)
    allocator_limit: int | None = None  # what the probe says the allocator may hold (fraction's cap, else device)

    @staticmethod
    def points_from_attempts(rows: Sequence[dict[str, Any]]) -> list[Point]:
        """Rebuild the points of a run from its journal (a restarted supervisor keeps learning)."""
        points = []
        for row in rows:
            if row["kind"] in MEMORY_KINDS:
                points.append(Point(row["micro_batch"], None, False))
            elif row["ended"] is not None and (peak := row.get("peak_allocated") or row["peak_gpu"]
                                               or row["peak_rss"]):
                points.append(Point(row["micro_batch"], peak, True))
        return points

    def capacity(self, sample: MemorySample | None) -> int | None:
        """The budget the model fits under: the allocator's limit where the probe reported one, else the
        GPU when there is one, else the host's limit."""
        if self.allocator_limit:
            return self.allocator_limit
        if sample is None:
            return self.memory_limit
        if sample.gpus:  # the smallest device decides: every rank must fit on its own GPU
            return min(g.total_bytes for g in sample.gpus)
        if self.memory_limit:
            return self.memory_limit
        if sample.cgroup and sample.cgroup.limit_bytes:
            return sample.cgroup.limit_bytes
        return sample.host_total_bytes

    def peak_bytes(self, peak: AttemptPeak | None, sample: MemorySample | None,
                   probe: AllocatorReport | None = None) -> int | None:
        """The attempt's peak as the model counts it: the allocator's step peak where the probe gave
        one (its limit then becomes the capacity), else NVML's GPU figure, else the worker's RSS."""
        if probe is not None and probe.allocated_peak:
            self.allocator_limit = probe.limit_bytes or self.allocator_limit
            return probe.allocated_peak
        if peak is None:
            return None
        if sample is not None and sample.gpus:
            return peak.worker_gpu_bytes
        return peak.worker_rss_bytes or None

    def record(self, micro: int, peak: int | None, memory_failed: bool) -> None:
        point = Point(micro, None if memory_failed else peak, not memory_failed)
        if point.succeeded and point.peak_bytes is None:
            return  # a success with no reading teaches nothing
        self.points.append(point)
        if self.store is not None and self.key is not None:
            try:
                self.store.record(self.key, point)
            except Exception:
                self.store = None

    def shrink_hint(self, failed_micro: int, sample: MemorySample | None) -> Prediction | None:
        capacity = self.capacity(sample)
        if capacity is None:
            return None
        return shrink_after_oom(self.points, failed_micro, self.per_process_batch, capacity, self.margin,
                                self.min_micro)

    def growth(self, current_micro: int, running_peak: int | None, sample: MemorySample | None
               ) -> Prediction | None:
        capacity = self.capacity(sample)
        if capacity is None or running_peak is None:
            return None
        points = [*self.points, Point(current_micro, running_peak, True)]
        return propose_growth(points, current_micro, self.per_process_batch, capacity, self.margin)

    def predicted_gpu_peak(self, micro: int, sample: MemorySample | None) -> float | None:
        """The model's GPU peak at ``micro`` (from measured peaks per sample), when it models a GPU."""
        gpu = self.allocator_limit is not None or (sample is not None and bool(sample.gpus))
        model = fit(self.points) if gpu else None
        return model.predict(micro) if model is not None else None

    def starting_micro(self, requested: int) -> int | None:
        """Where a fresh run of this job should start, from what earlier runs learned."""
        if self.store is None or self.key is None:
            return None
        try:
            record = self.store.load(self.key)
        except Exception:
            return None
        return record.starting_micro(self.per_process_batch, requested) if record else None
