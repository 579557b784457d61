"""How memory moves over one attempt: a straight-line fit over the readings after warm-up.

Both the attribution of a memory failure (``attribution.py``) and the forecast while an attempt
runs (``forecast.py``) ask the same question: does memory rise steadily while training goes on,
and how fast? ``steady_rise`` answers it from the samples the loop journals, with the slope
(bytes per second, and per step when the worker reports steps) and the fit quality (R²). A single
reading can never tell a leak from a spike; a line through many readings can. Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIB = 2**20
WARMUP_FRACTION = 0.25  # without steps, the first quarter of an attempt's readings is warm-up
WARMUP_STEPS = 2  # with steps, readings before the second step after the first one seen are warm-up
MIN_READINGS = 6  # fewer points after warm-up: too few to call anything a trend
MIN_SPAN_S = 2.0  # nor over a shorter stretch of time
# Fit quality that counts as "steady". A leak at steady throughput is a straight line (measured:
# R² 0.97-1.00 for a 4 MB/step leak sampled every 0.2-1 s, the staircase of per-step allocations
# included). The post-warm-up part of a per-sample ramp is a plateau: noise around a flat line
# gives R² near 0, and a ramp that bends into its plateau stays well under 0.9.
MIN_R2 = 0.9
# A steady rise must also matter: at least this share of the memory in use, and this many bytes,
# over the fitted stretch; allocator caches creep by a few MiB and are no leak.
MIN_RISE_FRACTION = 0.10
MIN_RISE_BYTES = 16 * MIB
FALL_FRACTION = 0.8  # a reading below this share of the highest one before it: the worker is dying
MIN_STEPS = 3  # with steps, memory must keep rising over at least this many training steps
# Without steps, the only sign that training went on while memory rose is how long it rose. One
# step's transient (a big batch allocating, an evaluation, pages swapped out as a cgroup fills)
# lasts seconds: measured, a rank filling a 1.5 GiB cgroup rose on a line (R² 0.96-0.98) for 5-6 s
# before the kernel killed it. A leak that ends a run builds up over many steps, minutes at least.
MIN_STEPLESS_SPAN_S = 30.0


@dataclass(frozen=True)
class Reading:
    """One memory reading of one attempt: when (seconds, any fixed origin), bytes, the step then."""

    t: float
    used: int
    step: int | None = None


@dataclass(frozen=True)
class Trend:
    """A straight line through the readings after warm-up."""

    per_s: float  # bytes per second
    per_step: float | None  # bytes per training step, when the worker reports steps
    r2: float  # coefficient of determination of the time fit
    readings: int  # how many readings the fit used
    span_s: float
    steps: int | None  # training steps covered by the fit; None when the worker reports no steps
    first: int  # fitted bytes at the start and end of the stretch
    last: int
    steps_r2: float | None = None  # how steadily the steps advanced (R² of step against time)

    @property
    def rise(self) -> int:
        return self.last - self.first

    def steady(self) -> bool:
        """Rising steadily, by enough to matter, while training went on (when steps are known)."""
        if self.per_s <= 0 or self.r2 < MIN_R2:
            return False
        if self.rise < max(MIN_RISE_BYTES, MIN_RISE_FRACTION * self.last):
            return False
        # "Trained steadily at its size": memory that rises while the steps stand still is a phase
        # (a long evaluation, a load), not a leak per step.
        if self.steps is None:
            return self.span_s >= MIN_STEPLESS_SPAN_S
        return self.steps >= MIN_STEPS and (self.steps_r2 or 0.0) >= MIN_R2

    def describe(self, what: str) -> str:
        """``worker RSS grew 4.0 MB/step, 39 MB/s (R² 0.99 over 42 samples, 12 s)``."""
        rates = [f"{self.per_s / 1e6:.1f} MB/s"]
        if self.per_step is not None:
            rates.insert(0, f"{self.per_step / 1e6:.1f} MB/step")
        return (f"{what} grew {', '.join(rates)} (R² {self.r2:.2f} over {self.readings} samples, "
                f"{self.span_s:.0f} s)")


def after_warmup(readings: Sequence[Reading]) -> list[Reading]:
    """The readings once the attempt is past warm-up (model load, first steps, allocator caches).

    With steps, warm-up ends at the second step after the first one seen: the first steps
    allocate the optimizer state and fill the caches. Without steps, the first quarter of the readings
    is dropped: enough to skip a per-sample ramp, little enough to keep most of a leak's line.
    """
    steps = [r.step for r in readings if r.step is not None]
    if steps:
        start = min(steps) + WARMUP_STEPS
        return [r for r in readings if r.step is not None and r.step >= start]
    skip = max(2, int(len(readings) * WARMUP_FRACTION))
    return list(readings[skip:])


def steady_rise(readings: Sequence[Reading]) -> Trend | None:
    """The line through the readings after warm-up, or None when there are too few to fit."""
    points = _until_the_fall(after_warmup(readings))
    if len(points) < MIN_READINGS or points[-1].t - points[0].t < MIN_SPAN_S:
        return None
    ts = [r.t for r in points]
    ys = [float(r.used) for r in points]
    slope, intercept = statistics.linear_regression(ts, ys)
    r2 = _r_squared(ts, ys)
    steps = [r.step for r in points if r.step is not None]
    per_step = steps_r2 = None
    covered = None
    if len(steps) == len(points):
        covered = steps[-1] - steps[0]  # 0: the steps stood still while memory moved
        if covered > 0:
            per_step = statistics.linear_regression([float(s) for s in steps], ys)[0]
            steps_r2 = _r_squared(ts, [float(s) for s in steps])
    return Trend(slope, per_step, r2, len(points), ts[-1] - ts[0], covered,
                 int(slope * ts[0] + intercept), int(slope * ts[-1] + intercept), steps_r2)


def _until_the_fall(points: list[Reading]) -> list[Reading]:
    """Without the readings taken as the worker was dying: the OOM killer (or an allocator error
    unwinding) frees memory before the exit is seen, and one such reading would bend the line."""
    peak = 0
    for i, r in enumerate(points):
        if r.used < FALL_FRACTION * peak:
            return points[:i]
        peak = max(peak, r.used)
    return points


def _r_squared(xs: Sequence[float], ys: Sequence[float]) -> float:
    """R² of the least-squares line (the squared Pearson correlation); 0 for a flat series."""
    try:
        return statistics.correlation(xs, ys) ** 2
    except statistics.StatisticsError:  # constant input: no trend at all
        return 0.0
