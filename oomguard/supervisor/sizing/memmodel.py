"""What memory a micro-batch needs: a pure model over a run's attempts, and the bookkeeping that
learns sizes within a run and across runs (the fit store's SQLite is record/fitstore.py).

Each attempt is a ``Point`` (its micro-batch, its peak, whether it ran or failed with an OOM); the
model fits ``peak ~= fixed + per_sample * micro`` to the successes, and answers on divisors of the
per-process batch only: ``shrink_after_oom`` (never above half the failed size unless two successes
back the line) and ``propose_growth`` (``--grow``: never at or above a size that failed). From one
point it assumes no fixed memory, or what the probe measured before the first forward or after the
first step: a floor of the real one, so predictions from one point err on the safe side. A peak is
the probe's allocator peak where it reports one (not NVML's view), under the limit it reports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from oomguard.common.batch import divisors
from oomguard.supervisor.observe.allocator import MEMORY_KINDS, AllocatorOom, AllocatorReport, OomProgress, integer
from oomguard.supervisor.observe.sampler import AttemptPeak, MemorySample

if TYPE_CHECKING:  # decide/policy imports decide/attribution, which imports this module
    from oomguard.supervisor.decide.policy import Decision


@dataclass(frozen=True)
class Point:
    """One attempt: ``peak_bytes`` is None when nothing was measured (e.g. an instant OOM)."""

    micro_batch: int
    peak_bytes: int | None
    succeeded: bool

    def __post_init__(self) -> None:
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")


@dataclass(frozen=True)
class Fit:
    """``peak(micro) = fixed_bytes + per_sample_bytes * micro``, from ``points`` successes."""

    fixed_bytes: float
    per_sample_bytes: float
    points: int

    def predict(self, micro_batch: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * micro_batch


@dataclass(frozen=True)
class Prediction:
    """A chosen micro-batch, the peak the model expects there (None: no model) and why."""

    micro_batch: int
    predicted_peak: float | None
    reason: str


def budget(capacity: float, margin: float, floor: float = 0.0) -> float:
    """The most a size may be predicted to need: the capacity less ``margin`` of the room above ``floor``."""
    return floor + (capacity - floor) * (1 - margin)


def fit(points: Iterable[Point], fixed_bytes: float = 0.0) -> Fit | None:
    """The line through the successful points (the worst peak of each size: that is what must fit), or
    None without one. A single point, or a line that noise between close sizes bent below 0 or flat,
    gives the safe line through ``fixed_bytes`` (a measured floor of the fixed memory, else 0)."""
    worst: dict[int, int] = {}
    for p in points:
        if p.succeeded and p.peak_bytes is not None:
            worst[p.micro_batch] = max(worst.get(p.micro_batch, 0), p.peak_bytes)
    if not worst:
        return None
    fixed = fixed_bytes if 0 < fixed_bytes < min(worst.values()) else 0.0
    if len(worst) == 1:
        (micro, peak), = worst.items()
        return Fit(fixed, (peak - fixed) / micro, 1)
    line = _least_squares(worst)
    if line is None or line.fixed_bytes < 0 or line.per_sample_bytes <= 0:
        return Fit(fixed, max((peak - fixed) / micro for micro, peak in worst.items()), len(worst))
    return line


def _least_squares(worst: dict[int, int]) -> Fit | None:
    xs, ys = list(worst), [float(v) for v in worst.values()]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    fixed = mean_y - slope * mean_x
    # The line must not under-predict any measured point: lift it to cover the worst residual.
    fixed += max(0.0, max(y - (fixed + slope * x) for x, y in zip(xs, ys, strict=True)))
    return Fit(fixed, slope, n)


@dataclass(frozen=True)
class OomFigures:
    """The allocator's figures at an OOM (the probe's ``oom`` record); ``fixed_bytes``: what the process
    held before its first forward (memory that does not follow the micro-batch; 0 when unknown)."""

    micro_batch: int
    requested_bytes: int
    allocated_bytes: int
    limit_bytes: int
    fixed_bytes: int = 0
    # How far through the forward the OOM came (1.0: the forward had returned; None: unknown), and
    # whether the figures count the address space (RLIMIT_AS) rather than allocated memory.
    forward_fraction: float | None = None
    address_space: bool = False

    def need_at(self, micro: int) -> float:
        """A lower bound of what ``micro`` needs at the same point of the program, if every tensor
        past the fixed memory has the batch dimension (activations do): the failed figures scaled."""
        scaled = (self.allocated_bytes + self.requested_bytes - self.fixed_bytes) * micro / self.micro_batch
        return self.fixed_bytes + scaled

    def proves_unfit(self, micro: int) -> bool:
        """Does the bound alone prove ``micro`` cannot fit? Only when the bound exceeds the limit: the
        failed request must be a large share of the room for a size well below the failed one."""
        return self.need_at(micro) > self.limit_bytes


def unfit(micro: int, points: Iterable[Point], oom: OomFigures | None = None) -> str | None:
    """Why the evidence proves ``micro`` cannot fit under the same limit, or None when it does not:
    a size at or above one that failed (memory does not shrink as the micro-batch grows), or the
    failed attempt's figures scaled down (``OomFigures.proves_unfit``)."""
    failed = _smallest_failure(points)
    if failed is not None and micro >= failed:
        return f"micro-batch {failed} already failed under this limit"
    if oom is not None and micro < oom.micro_batch and oom.proves_unfit(micro):
        return (f"at micro-batch {oom.micro_batch} the OOM asked {oom.requested_bytes} B on top of "
                f"{oom.allocated_bytes} B; scaled to {micro} that is {oom.need_at(micro):.3g} B > "
                f"the limit {oom.limit_bytes} B")
    return None


def _smallest_failure(points: Iterable[Point]) -> int | None:
    failed = [p.micro_batch for p in points if not p.succeeded]
    return min(failed) if failed else None


def _candidates(per_process_batch: int, low: int, high: int, points: Sequence[Point]) -> list[int]:
    """Divisors in [low, high] below the smallest failed size (memory only grows with it), largest first."""
    failed = _smallest_failure(points)
    ceiling = min(high, failed - 1) if failed is not None else high
    return [d for d in reversed(divisors(per_process_batch)) if low <= d <= ceiling]


def shrink_after_oom(points: Sequence[Point], failed_micro: int, per_process_batch: int, capacity_bytes: int,
                     margin: float = 0.1, min_micro: int = 1, oom: OomFigures | None = None,
                     fixed_bytes: float = 0.0, floor: float = 0.0) -> Prediction | None:
    """The micro-batch to try after an OOM at ``failed_micro``, never one the evidence proves cannot
    fit (``unfit``); None at the floor (no divisor from ``min_micro`` up is left below the failed size)."""
    _check(per_process_batch, capacity_bytes, margin)
    known = [*points, Point(failed_micro, None, False)]
    model = fit(known, fixed_bytes)
    trusted = model is not None and model.points >= 2
    high = per_process_batch if trusted else failed_micro // 2
    options = _candidates(per_process_batch, min_micro, high, known)
    # Sizes the OOM's own figures prove cannot fit are skipped, not tried (the next halving may be one).
    options = [m for m in options if unfit(m, known, oom) is None]
    if not options:
        return None
    if model is None:
        return Prediction(options[0], None, f"no successful attempt yet: largest divisor <= {failed_micro}/2")
    room = budget(capacity_bytes, margin, floor)
    for micro in options:
        if model.predict(micro) <= room:
            return Prediction(micro, model.predict(micro), _why(model, room, trusted, failed_micro))
    # Nothing is predicted to fit: the model may be wrong (fragmentation, a one-off spike), and
    # the smallest size is the best remaining chance before the floor's fallbacks.
    smallest = options[-1]
    why = f"model predicts nothing fits under {room:.3g} B; trying the smallest"
    return Prediction(smallest, model.predict(smallest), why)


def propose_growth(points: Sequence[Point], current_micro: int, per_process_batch: int, capacity_bytes: int,
                   margin: float = 0.1, min_factor: float = 1.0, fixed_bytes: float = 0.0,
                   floor: float = 0.0) -> Prediction | None:
    """A larger micro-batch to restart with (``--grow``: the largest divisor of at least ``min_factor``
    × ``current_micro`` predicted to fit, below any size that failed), or None to stay."""
    _check(per_process_batch, capacity_bytes, margin)
    model = fit(points, fixed_bytes)
    if model is None:
        return None
    room = budget(capacity_bytes, margin, floor)
    low = max(current_micro + 1, math.ceil(current_micro * min_factor))
    for micro in _candidates(per_process_batch, low, per_process_batch, points):
        if model.predict(micro) <= room:
            return Prediction(micro, model.predict(micro), _why(model, room, model.points >= 2, None))
    return None


def _why(model: Fit, room: float, trusted: bool, failed_micro: int | None) -> str:
    fixed = (f"fixed {model.fixed_bytes:.3g} B measured by the probe" if model.fixed_bytes
             else "no fixed memory assumed")
    shape = (f"fixed {model.fixed_bytes:.3g} B + {model.per_sample_bytes:.3g} B/sample from {model.points} sizes"
             if trusted else f"{model.per_sample_bytes:.3g} B/sample from one size, {fixed}")
    cap = "" if trusted or failed_micro is None else f", at most {failed_micro}/2"
    return f"model: {shape}; budget {room:.3g} B{cap}"


def _check(per_process_batch: int, capacity_bytes: int, margin: float) -> None:
    if per_process_batch < 1:
        raise ValueError(f"per-process batch must be >= 1, got {per_process_batch}")
    if capacity_bytes <= 0:
        raise ValueError(f"capacity must be positive, got {capacity_bytes}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")


# ----- what a job has learned, and where it is kept across runs (record/fitstore.py does the I/O)


class Key(Protocol):
    """What a fit store's record is kept under: record/fitstore.py's ``JobKey``."""

    @property
    def fingerprint(self) -> str: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class ModelPrint:
    """One model as the probe saw it at a first step: its digest tells models apart, its size names them."""

    digest: str
    params: int
    tensors: int = 0

    @classmethod
    def from_record(cls, record: dict[str, object]) -> ModelPrint | None:
        digest, params = record.get("digest"), integer(record, "params")
        if not isinstance(digest, str) or not digest or params is None:
            return None
        return cls(digest, params, integer(record, "tensors") or 0)


def merge_models(old: Sequence[ModelPrint], new: Sequence[ModelPrint]) -> tuple[ModelPrint, ...]:
    """Both lists' models, each digest once (ranks of one job may train different stages)."""
    seen = {m.digest: m for m in new}
    seen.update({m.digest: m for m in old})
    return tuple(sorted(seen.values(), key=lambda m: m.digest))


@dataclass(frozen=True)
class FitRecord:
    """What one job has learned: the largest size that worked, the smallest that failed, one point per size."""

    fingerprint: str
    description: str
    micro_batch: int | None
    failed_micro: int | None
    points: tuple[Point, ...]
    updated_wall: float
    models: tuple[ModelPrint, ...] = ()  # what the points were measured with; () where unknown

    def measured(self, model: ModelPrint) -> bool | None:
        """Whether this record was measured with ``model``; None where it does not know its models."""
        if not self.models:
            return None
        return any(m.digest == model.digest for m in self.models)

    def starting_micro(self, per_process_batch: int, requested: int) -> int | None:
        """Where a new run starts: below any size that failed, never above ``requested``; None: at ``requested``."""
        ceiling = requested
        if self.failed_micro is not None:
            # Sizes between the largest that worked and the smallest that failed are untested:
            # start at one that worked (``--grow`` may explore upwards later).
            ceiling = min(ceiling, self.failed_micro - 1, self.micro_batch or ceiling)
        fitting = [d for d in divisors(per_process_batch) if d <= ceiling]
        if not fitting or fitting[-1] == requested:
            return None
        return fitting[-1]


def merge_point(record: FitRecord, point: Point, now: float) -> FitRecord:
    """``record`` with one more attempt folded in (pure)."""
    by_micro = {p.micro_batch: p for p in record.points}
    old = by_micro.get(point.micro_batch)
    by_micro[point.micro_batch] = _merge(old, point) if old else point
    points = tuple(sorted(by_micro.values(), key=lambda p: p.micro_batch))
    good = [p.micro_batch for p in points if p.succeeded]
    return replace(record, points=points, micro_batch=max(good, default=None),
                   failed_micro=_smallest_failure(points), updated_wall=now)


def _merge(old: Point, new: Point) -> Point:
    # A size that failed once stays failed; a success keeps the worst peak it ever showed.
    succeeded = old.succeeded and new.succeeded
    peaks = [p for p in (old.peak_bytes, new.peak_bytes) if p is not None]
    return Point(new.micro_batch, max(peaks) if peaks else None, succeeded)


class Store(Protocol):
    """Where what fits is remembered across runs: record/fitstore.py's ``FitStore`` (SQLite)."""

    def load(self, key: Key) -> FitRecord | None: ...

    def record(self, key: Key, point: Point, models: Sequence[ModelPrint] = ()) -> FitRecord: ...

    def rewrite(self, key: Key, points: Sequence[Point], models: Sequence[ModelPrint]) -> FitRecord: ...


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
    store: Store | None = None
    key: Key | None = None
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
        """The budget the model fits under: the probe's allocator limit, else the GPU, else the host's limit."""
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
        """A process reported the model it trains (at its first step, at ``micro``): a ModelChange, once
        per run, when the record that steers the run was measured with another model. Another model is
        another job: its record stops steering, and a run it started below the size asked for restarts
        there at once, before anything was measured (a step lost, not the whole run's throughput)."""
        self.models = merge_models(self.models, [model])
        if self.model_checked:
            return None
        self.model_checked = True
        if not self.measured_with or any(m.digest == model.digest for m in self.measured_with):
            return None  # the same model, or a record that does not know its model: today's behaviour
        then = max(self.measured_with, key=lambda m: m.params)
        restart = micro == self.fitted_start and not self.points
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
        """What an OOM's figures tell beyond the attempt: the fixed memory, and a CPU worker's RLIMIT_AS."""
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
        """Where a new run starts: below any size that failed, never above ``requested``; None: at ``requested``."""
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
    """The probe's figures at an OOM (a CUDA OOM's allocator, a host OOM's address space under
    RLIMIT_AS) as the model's bound takes them; None where it did not see them all."""
    if progress is not None and progress.requested is not None and progress.held is not None and progress.limit:
        return OomFigures(progress.micro_batch or micro_batch, progress.requested, progress.held, progress.limit,
                          progress.fixed or 0, progress.forward_fraction, progress.memory == "address_space")
    if oom is None or oom.requested is None or oom.allocated is None or not oom.limit:
        return None
    return OomFigures(oom.micro_batch or micro_batch, oom.requested, oom.allocated, oom.limit)


# A prediction beyond proof (``--predict-shrink``): from how far through the forward an OOM came,
# the largest micro-batch a whole step is predicted to need no more than the budget.
#
# ``unfit`` only skips sizes the evidence proves cannot fit; halving from there takes one
# restart per halving. The probe also says what share of the failed attempt's forward had run
# (``OomFigures.forward_fraction``) and what the process held before it (``fixed_bytes``: weights,
# optimizer state). Memory past the fixed part follows the micro-batch and the forward's progress, and
# the backward holds the forward's saved activations while it makes gradients of the same size, so
#
#     need(m) ~= fixed + STEP * (held + requested - fixed) / fraction * m / failed_micro
#
# When the forward had returned (the OOM came in the loss or the backward) the figures already hold
# the forward's activations and part of the backward: they are scaled as they are (no ``STEP``), a
# bound of the step rather than an extrapolation, so a backward OOM rarely goes below the halving.
# This is no proof: memory need
# not grow evenly through the forward (its share of leaf modules run is not its share of memory), and
# a first step's optimizer state comes on top. So the
# prediction is used only where it goes further down than the proven path would (fewer restarts
# when the OOM came early at a size far too large), never below ``--min-micro-batch``; the next
# attempt checks it (an OOM there is met by the proven path), and ``--grow`` climbs back toward the
# largest size that fits when it went too far.


STEP = 2.0  # a whole step's memory past the fixed part, in whole forwards (activations, then their gradients)


def per_sample(oom: OomFigures) -> float | None:
    """A whole step's bytes per sample past the fixed memory; None where the figures cannot tell
    (no fraction, a fraction outside (0, 1], no fixed memory measured, or nothing past it)."""
    fraction = oom.forward_fraction
    if fraction is None or not 0 < fraction <= 1 or oom.fixed_bytes <= 0:
        return None
    grown = oom.allocated_bytes + oom.requested_bytes - oom.fixed_bytes
    if grown <= 0 or oom.micro_batch < 1:
        return None
    whole = 1.0 if fraction == 1.0 else STEP  # a backward OOM's figures hold the forward and more
    return whole * grown / fraction / oom.micro_batch


def predict_after_oom(oom: OomFigures | None, proven: int, per_process_batch: int, margin: float,
                      min_micro: int, points: Sequence[Point] = ()) -> Prediction | None:
    """The largest divisor of the per-process batch predicted to fit under the OOM's limit, when it is
    below ``proven`` (the size the proven path would try); None when there is no such prediction."""
    if oom is None or (slope := per_sample(oom)) is None:
        return None
    # Under RLIMIT_AS most of the limit is address space mapped before the forward: the margin is of the room.
    room = budget(oom.limit_bytes, margin, oom.fixed_bytes if oom.address_space else 0.0)
    failed = [*points, Point(oom.micro_batch, None, False)]
    below = [d for d in reversed(divisors(per_process_batch)) if d < oom.micro_batch and unfit(d, failed) is None]
    fits = next((d for d in below if oom.fixed_bytes + slope * d <= room), None)
    floor = fits is None or fits < min_micro
    chosen = min_micro if floor else fits
    assert chosen is not None
    if chosen >= proven or per_process_batch % chosen:
        return None
    need = oom.fixed_bytes + slope * chosen
    where = ("after the forward had returned" if oom.forward_fraction == 1.0
             else f"{oom.forward_fraction:.0%} through the forward")
    told = (f"--min-micro-batch {min_micro} (nothing at or above it is predicted to fit)" if floor
            else f"micro-batch {chosen}, predicted to need {need:.3g} B")
    reason = (f"prediction beyond proof: at micro-batch {oom.micro_batch} the OOM came {where} holding "
              f"{oom.allocated_bytes} B (fixed {oom.fixed_bytes} B) and asking {oom.requested_bytes} B more: "
              f"{slope:.3g} B/sample for a whole step{'' if oom.forward_fraction == 1.0 else ' (twice the forward)'}, "
              f"so {told} under the budget {room:.3g} B "
              f"(the proven path would try {proven}; the next attempt checks it, --grow climbs back)")
    return Prediction(chosen, need, reason)


def jump(decision: Decision, failed_micro: int, prediction: Prediction | None) -> Decision:
    """The policy's decision after a memory failure at ``failed_micro``, taken down to the predicted
    size when it shrinks the micro-batch (not a retry at the same size) and the prediction is smaller."""
    if prediction is None or not decision.restart:
        return decision
    batch = decision.plan.batch
    if batch.micro_batch >= failed_micro or prediction.micro_batch >= batch.micro_batch:
        return decision
    if not batch.fits(prediction.micro_batch):
        return decision
    plan = replace(decision.plan, batch=batch.with_micro_batch(prediction.micro_batch))
    return replace(decision, plan=plan, reason=f"{decision.reason}; {prediction.reason}: {plan.batch.describe()}")
