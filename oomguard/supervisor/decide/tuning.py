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

from oomguard.supervisor.decide.fitstore import FitStore, JobKey, ModelPrint, merge_models
from oomguard.supervisor.decide.memmodel import OomFigures, Point, Prediction, fit, propose_growth, shrink_after_oom
from oomguard.supervisor.observe.allocator import AllocatorOom, AllocatorReport, OomProgress
from oomguard.supervisor.observe.memory import AttemptPeak, MemorySample

MEMORY_KINDS = ("cuda_oom", "host_oom", "memory_limit")


@dataclass(frozen=True)
class ModelChange:
    """The probe's model is not the one the fit store's record was measured with."""

    then: ModelPrint  # (one of) the record's
    now: ModelPrint
    restart_at: int | None  # the size asked for, to restart at now; None: this attempt runs on

    @property
    def text(self) -> str:
        then, now = self.then.params, self.now.params
        what = (f"{now:,} parameters, the fit store's record was measured with {then:,}" if now != then else
                f"{now:,} parameters as before, but other shapes, dtypes or optimizer")
        follow = (f"restarting at the micro-batch asked for, {self.restart_at}" if self.restart_at is not None
                  else "this run's measurements replace the record")
        return f"the model differs from the one the fit store measured ({what}): {follow}"


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
    stored_failures: list[Point] = field(default_factory=list)  # earlier runs' OOMs under the same key
    # What the probe saw held before a first forward (a floor of the line's fixed memory), and whether
    # the figures count the address space (RLIMIT_AS bounds the worker: its mapped libraries sit under
    # the limit, so the margin is taken of the room above that floor).
    fixed_bytes: int = 0
    address_space: bool = False
    # The model (``ModelPrint``) this run trains, as the probe reported it; the models the loaded
    # record was measured with; the size the record made this run start at, and the size asked for.
    models: tuple[ModelPrint, ...] = ()
    measured_with: tuple[ModelPrint, ...] = ()
    fitted_start: int | None = None
    requested: int | None = None
    model_checked: bool = False

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
            self._fixed_after_step(probe, "cuda_allocated", probe.allocated_peak)
            return probe.allocated_peak
        if probe is not None and probe.vm_peak and probe.vm_limit:  # a CPU worker under RLIMIT_AS
            self.allocator_limit, self.address_space = probe.vm_limit, True
            self._fixed_after_step(probe, "address_space", probe.vm_peak)
            return probe.vm_peak
        if self.address_space:
            return None  # the model counts the address space: an RSS reading is no point on its line
        if peak is None:
            return None
        if sample is not None and sample.gpus:
            return peak.worker_gpu_bytes
        return peak.worker_rss_bytes or None

    def record(self, micro: int, peak: int | None, memory_failed: bool) -> None:
        # A success with no reading (no per-process GPU figures, as in many containers) still proves
        # the size fits: the fit store starts the next run there. The line ignores it.
        point = Point(micro, None if memory_failed else peak, not memory_failed)
        self.points.append(point)
        if self.store is not None and self.key is not None:
            try:
                self.store.record(self.key, point, self.models)
            except Exception:
                self.store = None

    def model_seen(self, model: ModelPrint, micro: int) -> ModelChange | None:
        """A process reported the model it trains (at its first optimizer step, at size ``micro``).
        The first report of the run is checked against the record that steers it; a ModelChange
        when that record was measured with another model (said once per run).

        Another model is another job: its record's sizes and failures stop steering (the failures
        no longer bar sizes after an OOM) and this run's own measurements replace it. If the record
        made this run start below the size asked for, and nothing was measured yet, it restarts at
        once at the size asked for, as a job never measured would have started: this first step
        is the cheapest moment (a step lost), and running on would cost throughput for the whole
        run (without --grow it never climbs back), for a size measured on a model it is not."""
        self.models = merge_models(self.models, [model])
        if self.model_checked:
            return None
        self.model_checked = True
        if not self.measured_with or any(m.digest == model.digest for m in self.measured_with):
            return None  # the same model, or a record that does not know its model: today's behaviour
        then = max(self.measured_with, key=lambda m: m.params)
        restart = self.fitted_start is not None and micro == self.fitted_start and not self.points
        self.measured_with, self.stored_failures = (), []
        if self.store is not None and self.key is not None:
            try:
                self.store.rewrite(self.key, self.points, self.models)
            except Exception:
                self.store = None
        return ModelChange(then, model, self.requested if restart else None)

    def _fixed_after_step(self, probe: AllocatorReport, measure: str, peak: int) -> None:
        """What the worker held right after its first optimizer step (weights, gradients, optimizer
        state) is the line's fixed memory, where the probe read it below the peak."""
        held = probe.held_after_step.get(measure)
        if held is not None and held < peak:
            self.fixed_bytes = held

    def learn(self, oom: OomFigures | None) -> None:
        """What an OOM's figures tell about the memory beyond the attempt: the fixed memory, and the
        address-space limit a CPU worker runs under."""
        if oom is None:
            return
        if oom.address_space:
            self.allocator_limit, self.address_space = oom.limit_bytes, True
        if oom.fixed_bytes > self.fixed_bytes:  # before the first forward: a floor of the fixed memory
            self.fixed_bytes = oom.fixed_bytes

    @property
    def _floor(self) -> float:
        return float(self.fixed_bytes) if self.address_space else 0.0

    def shrink_hint(self, failed_micro: int, sample: MemorySample | None, oom: OomFigures | None = None
                    ) -> Prediction | None:
        """Where to go after an OOM: never to a size this run or an earlier run of the same job (same
        key: script, device, limit) saw fail, nor one ``oom``'s figures prove cannot fit."""
        # Without a device sample the allocator's own limit at the OOM (the fraction's cap) is the room.
        capacity = self.capacity(sample) or (oom.limit_bytes if oom is not None else None)
        if capacity is None:
            return None
        return shrink_after_oom([*self.stored_failures, *self.points], failed_micro, self.per_process_batch,
                                capacity, self.margin, self.min_micro, oom, self.fixed_bytes, self._floor)

    def growth(self, current_micro: int, running_peak: int | None, sample: MemorySample | None
               ) -> Prediction | None:
        capacity = self.capacity(sample)
        if capacity is None or running_peak is None:
            return None
        points = [*self.points, Point(current_micro, running_peak, True)]
        return propose_growth(points, current_micro, self.per_process_batch, capacity, self.margin,
                              fixed_bytes=self.fixed_bytes, floor=self._floor)

    def predicted_gpu_peak(self, micro: int, sample: MemorySample | None) -> float | None:
        """The model's GPU peak at ``micro`` (from measured peaks per sample), when it models a GPU."""
        allocator = self.allocator_limit is not None and not self.address_space  # a CPU's RLIMIT_AS is no GPU
        gpu = allocator or (sample is not None and bool(sample.gpus))
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
        if record is None:
            return None
        self.stored_failures = [p for p in record.points if not p.succeeded]
        self.measured_with, self.requested = record.models, requested
        self.fitted_start = record.starting_micro(self.per_process_batch, requested)
        return self.fitted_start


def figures_at_oom(oom: AllocatorOom | None, micro_batch: int, progress: OomProgress | None = None
                   ) -> OomFigures | None:
    """The probe's figures at an OOM as the memory model's bound takes them: a CUDA OOM's allocator
    figures, or a host OOM's address space under RLIMIT_AS, with the fixed memory and the forward's
    progress where the probe saw them; None where it did not see the request, the holding or the limit."""
    if progress is not None and progress.requested is not None and progress.held is not None and progress.limit:
        return OomFigures(progress.micro_batch or micro_batch, progress.requested, progress.held, progress.limit,
                          progress.fixed or 0, progress.forward_fraction, progress.memory == "address_space")
    if oom is None or oom.requested is None or oom.allocated is None or not oom.limit:
        return None
    return OomFigures(oom.micro_batch or micro_batch, oom.requested, oom.allocated, oom.limit)
