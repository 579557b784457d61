"""Learning what fits: a pure memory model over the attempts a run has made.

Each attempt contributes a ``Point``: its micro-batch, the peak memory it reached and whether it
ran (``succeeded``: it trained for a while without a memory failure) or failed with an OOM. The
model fits ``peak ~= fixed + per_sample * micro`` to the successful points and answers two
questions, both restricted to divisors of the per-process batch so the global batch stays exact:

- ``shrink_after_oom``: after an OOM at ``failed``, the largest micro-batch predicted to fit under
  ``capacity * (1 - margin)``. It never goes above half the failed size unless at least two
  successful points back the line (one point cannot tell fixed memory from per-sample memory).
- ``propose_growth`` (``--grow``): a larger micro-batch predicted to fit, below every size that
  ever failed.

With a single successful point the model assumes no fixed memory (peak scales with the
micro-batch), or, where the probe measured what the process held before its first forward or right
after its first optimizer step (``fixed_bytes``), that much. Neither over-states the real fixed memory
(the one before the first forward lacks the gradients and the optimizer state a first step allocates),
so the per-sample cost is not under-estimated and predictions from one point err on the safe side.

The budget is ``capacity * (1 - margin)``; where a ``floor`` is given (under ``RLIMIT_AS``: the address
space mapped before the first forward, libraries mostly, which no margin needs to protect) the
margin is taken of the room above it (``budget``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from oomguard.common.batch import divisors


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
    """The line through the successful points, or None with no successful measured point.

    Several successes at one size keep the highest peak (peaks vary step to step; the worst one
    is what must fit). A line whose intercept comes out negative or whose slope is not positive
    (noise between close sizes) is replaced by the safe line through ``fixed_bytes`` (a measured
    lower bound of the fixed memory, 0 when unknown), as is a single point.
    """
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
    """The allocator's figures at an OOM (the in-process probe's ``oom`` record): the attempt at
    ``micro_batch`` held ``allocated_bytes`` and asked for ``requested_bytes`` more under
    ``limit_bytes``; ``fixed_bytes`` is what it held before its first forward (weights, optimizer
    state: memory that does not follow the micro-batch; 0 when unknown, which only weakens the bound)."""

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
    """Divisors in [low, high] below the smallest failed size, largest first.

    A size at or above one that failed is out: memory only grows with the micro-batch.
    """
    failed = _smallest_failure(points)
    ceiling = min(high, failed - 1) if failed is not None else high
    return [d for d in reversed(divisors(per_process_batch)) if low <= d <= ceiling]


def shrink_after_oom(
    points: Sequence[Point],
    failed_micro: int,
    per_process_batch: int,
    capacity_bytes: int,
    margin: float = 0.1,
    min_micro: int = 1,
    oom: OomFigures | None = None,
    fixed_bytes: float = 0.0,
    floor: float = 0.0,
) -> Prediction | None:
    """The micro-batch to try after an OOM at ``failed_micro`` (which ``points`` should include),
    never one the evidence proves cannot fit (``unfit``; ``oom``: the allocator's figures at it).

    None when no divisor at or above ``min_micro`` is left below the failed size: the caller is
    at the floor (fallbacks, then give up).
    """
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


def propose_growth(
    points: Sequence[Point],
    current_micro: int,
    per_process_batch: int,
    capacity_bytes: int,
    margin: float = 0.1,
    min_factor: float = 1.0,
    fixed_bytes: float = 0.0,
    floor: float = 0.0,
) -> Prediction | None:
    """A larger micro-batch to restart with (``--grow``), or None to stay.

    The target is the largest divisor at least ``min_factor`` x ``current_micro`` (and strictly
    larger), never at or above a size that failed, and predicted to fit under the margin.
    """
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
    shape = (
        f"fixed {model.fixed_bytes:.3g} B + {model.per_sample_bytes:.3g} B/sample from {model.points} sizes"
        if trusted
        else f"{model.per_sample_bytes:.3g} B/sample from one size, {fixed}"
    )
    cap = "" if trusted or failed_micro is None else f", at most {failed_micro}/2"
    return f"model: {shape}; budget {room:.3g} B{cap}"


def _check(per_process_batch: int, capacity_bytes: int, margin: float) -> None:
    if per_process_batch < 1:
        raise ValueError(f"per-process batch must be >= 1, got {per_process_batch}")
    if capacity_bytes <= 0:
        raise ValueError(f"capacity must be positive, got {capacity_bytes}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
