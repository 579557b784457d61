"""How memory moves over one attempt: a straight-line fit over the readings after warm-up.

``steady_rise`` answers, for the attribution of a failure and the forecast while an attempt runs,
whether memory rises steadily while training goes on and how fast (slope, R², the readings' noise);
readings at the end that jump above the line are a ``Jump``, kept apart (a spike is not the trend).
``Headroom`` extends the line to a limit: how long until it reaches it, or how far from it the line
was at a failure. Also here: when a steady rise will reach the limit, and whether to restart at the
next checkpoint before it does. Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from oomguard.supervisor.observe.progress import duration
from oomguard.supervisor.observe.sampler import MemorySample
from oomguard.supervisor.units import MIB, format_size

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
# How close to the line a reading, or the line to a limit, must be to count as on it. Readings
# scatter about a leak's line with the step's own allocations (a sawtooth: its top is ~1.7 σ above
# the line) and with the sampling moment; 3 σ covers that scatter (99.7 % of Gaussian noise), so a
# leak's line at the failure lies within 3 σ of the limit that killed it, and a reading more than
# 3 σ above the line is no scatter but a jump. A near-perfect line (σ ~ 0) would make any gap a
# jump; the floor is what readings cannot see at all: the kernel's own memory charged to the cgroup
# (page tables, socket buffers, kernel stacks) and the moment between the last reading and the
# kill. Measured on real kernel kills in a 400 MiB cgroup: a 4 MiB/step leak's readings scatter
# σ 1.4-4.1 MiB about its line, and the line, carried to the moment the exit was seen, is 12-30 MiB
# past the limit (tolerance 8-12 MiB); a 0.5 MiB/step creep scatters σ 0.2-0.7 MiB, and its line
# was 244-251 MiB below the limit when a spike killed the worker (tolerance 8 MiB).
NOISE_SIGMAS = 3.0
TOLERANCE_FRACTION = 0.02  # of the limit (or, for a jump, of the memory in use at the reading)
MAX_JUMP_FRACTION = 0.5  # at most this share of the readings can be a jump at the end; more is a new level
MAX_JUMP_READINGS = 30  # nor more than this many: a jump is the last seconds, not the last minutes


@dataclass(frozen=True)
class Reading:
    """One memory reading of one attempt: when (seconds, any fixed origin), bytes, the step then."""

    t: float
    used: int
    step: int | None = None


@dataclass(frozen=True)
class Jump:
    """The last readings of the stretch, above the line of the readings before them."""

    readings: int  # how many
    above: int  # bytes the highest of them was above the line
    t: float  # when the first of them was taken


@dataclass(frozen=True)
class Trend:
    """A straight line through the readings after warm-up (a jump at the end left out)."""

    per_s: float  # bytes per second
    per_step: float | None  # bytes per training step, when the worker reports steps
    r2: float  # coefficient of determination of the time fit
    readings: int  # how many readings the fit used
    span_s: float
    steps: int | None  # training steps covered by the fit; None when the worker reports no steps
    first: int  # fitted bytes at the start and end of the stretch
    last: int
    steps_r2: float | None = None  # how steadily the steps advanced (R² of step against time)
    t_last: float = 0.0  # when the last fitted reading was taken
    noise: float = 0.0  # standard deviation of the readings about the line, bytes
    jump: Jump | None = None  # the last readings jumped above the line

    @property
    def rise(self) -> int:
        return self.last - self.first

    def at(self, t: float) -> float:
        """The line's bytes at ``t`` (extended past the readings when ``t`` is later)."""
        return self.last + self.per_s * (t - self.t_last)

    def tolerance(self, scale: float) -> float:
        """How far from the line still counts as on it, for memory of about ``scale`` bytes."""
        return max(NOISE_SIGMAS * self.noise, TOLERANCE_FRACTION * scale)

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
        """``worker RSS rose steadily by 126.0 MiB in 12 s (about 3.8 MiB a step)``."""
        if not self.steady():
            return f"{what} showed no steady rise ({format_size(self.rise)} over {duration(self.span_s)})"
        text = f"{what} rose steadily by {format_size(self.rise)} in {duration(self.span_s)}"
        if self.per_step is not None and self.per_step > 0:
            text += f" (about {format_size(self.per_step)} a step)"
        return text


def limit_words(budget: str, limit: int) -> str:
    """``the cgroup limit of 400.0 MiB``, ``the 400.0 MiB --memory-limit``, ``the host's 62.0 GiB``."""
    if budget == "host":
        return f"the host's {format_size(limit)}"
    if budget.startswith("--"):
        return f"the {format_size(limit)} {budget}"
    return f"the {budget} limit of {format_size(limit)}"


def after_warmup(readings: Sequence[Reading]) -> list[Reading]:
    """The readings once the attempt is past warm-up (the first steps allocate the optimizer state and
    fill the caches); without steps, the first quarter: enough to skip a per-sample ramp, little
    enough to keep most of a leak's line."""
    steps = [r.step for r in readings if r.step is not None]
    if steps:
        start = min(steps) + WARMUP_STEPS
        return [r for r in readings if r.step is not None and r.step >= start]
    skip = max(2, int(len(readings) * WARMUP_FRACTION))
    return list(readings[skip:])


def steady_rise(readings: Sequence[Reading]) -> Trend | None:
    """The line through the readings after warm-up, or None when there are too few to fit; a jump at
    the end is left out of it (its ``jump``): one spike must neither bend a steady line nor pass for one."""
    points = _until_the_fall(after_warmup(readings))
    if len(points) < MIN_READINGS or points[-1].t - points[0].t < MIN_SPAN_S:
        return None
    body, jump = _without_jump(points)
    if body[-1].t - body[0].t < MIN_SPAN_S:
        return None
    return _fit(body, jump)


@dataclass(frozen=True)
class Headroom:
    """A trend against one limit at one moment: for the forecast, how long until the line reaches it;
    for the attribution, how far below it the line was at the failure. One model, so the two agree."""

    budget: str  # which limit: "cgroup", "GPU", "--memory-limit", "host"
    limit: int
    trend: Trend
    t: float

    @property
    def expected(self) -> int:
        return int(self.trend.at(self.t))

    @property
    def distance(self) -> int:
        """Bytes from the line to the limit (negative: the line is past it)."""
        return self.limit - self.expected

    @property
    def tolerance(self) -> int:
        return int(self.trend.tolerance(self.limit))

    @property
    def reached(self) -> bool:
        """Did the line reach the limit (within the readings' noise)?"""
        return self.distance <= self.tolerance

    @property
    def seconds(self) -> float:
        """Seconds until the line reaches the limit at its rate (inf when it does not rise)."""
        if self.distance <= 0:
            return 0.0
        return self.distance / self.trend.per_s if self.trend.per_s > 0 else math.inf

    @property
    def steps(self) -> float | None:
        """Training steps until the line reaches the limit, when the worker reports steps."""
        per_step = self.trend.per_step
        if per_step is None or per_step <= 0:
            return None
        return max(0.0, self.distance / per_step)

    @property
    def rise(self) -> int:
        """Bytes the line rose in the attempt, up to the moment."""
        return self.expected - self.trend.first

    @property
    def needed(self) -> int:
        """Bytes a failure needed on top of the line: the room left, or the jump where that was more."""
        return max(self.distance, self.trend.jump.above if self.trend.jump else 0)

    @property
    def falling_below_zero(self) -> bool:
        """The line, carried to the moment, is below 0 bytes: a falling line says no memory figure there."""
        return self.trend.at(self.t) < 0

    def describe(self) -> str:
        """``its steady rise was at about 117.0 MiB when it failed, 283.0 MiB below the cgroup limit of
        400.0 MiB``: in plain words; the statistics stay in the journal's figures."""
        limit = limit_words(self.budget, self.limit)
        if self.falling_below_zero:
            return f"its {self.budget} readings were falling, which says nothing of {limit}"
        line = "its steady rise" if self.trend.steady() else f"the trend of its {self.budget} readings"
        if self.distance < 0:
            return (f"{line} had passed {limit} when it failed (about {format_size(self.expected)}, "
                    f"{format_size(-self.distance)} over)")
        if self.reached:
            return (f"{line} had reached {limit} when it failed (about {format_size(self.expected)}, "
                    "within the readings' noise)")
        return (f"{line} was at about {format_size(self.expected)} when it failed, "
                f"{format_size(self.distance)} below {limit}")


def _without_jump(points: list[Reading]) -> tuple[list[Reading], Jump | None]:
    """The readings before the jump at the end, and the jump: the longest run of last readings all
    above the line of the readings before the run (never a line they helped to bend, whose noise a
    spike caught by several readings would inflate enough to hide in)."""
    n = len(points)
    lines = _PrefixLines(points)
    longest = max(MIN_READINGS, n - MAX_JUMP_READINGS, int(n * (1 - MAX_JUMP_FRACTION)))
    # One reading more than the longest jump is tried too: found there, the run above the line is
    # longer than a jump can be, and memory moved to a new level instead.
    for k in range(max(MIN_READINGS, longest - 1), n):
        if points[k - 1].t - points[0].t < MIN_SPAN_S:
            continue
        at, spread = lines.line(k)
        tail = points[k:]
        if all(r.used - at(r.t) > max(NOISE_SIGMAS * spread(r.t), TOLERANCE_FRACTION * r.used) for r in tail):
            if k < longest:
                return points, None
            return points[:k], Jump(len(tail), int(max(r.used - at(r.t) for r in tail)), tail[0].t)
    return points, None


class _PrefixLines:
    """Least-squares lines through every prefix of the readings, each in O(1) from running sums
    (times and bytes taken from the first reading, so the sums keep their precision)."""

    def __init__(self, points: Sequence[Reading]) -> None:
        self.t0, self.y0 = points[0].t, float(points[0].used)
        self.sums = [(0.0, 0.0, 0.0, 0.0, 0.0)]
        st = sy = stt = sty = syy = 0.0
        for r in points:
            t, y = r.t - self.t0, r.used - self.y0
            st, sy, stt, sty, syy = st + t, sy + y, stt + t * t, sty + t * y, syy + y * y
            self.sums.append((st, sy, stt, sty, syy))

    def line(self, k: int) -> tuple[Callable[[float], float], Callable[[float], float]]:
        """The line through the first ``k`` readings (bytes at a time), and how far a new reading at a
        time scatters about it: one σ of the least-squares fit's prediction interval."""
        st, sy, stt, sty, syy = self.sums[k]
        spread = k * stt - st * st
        slope = (k * sty - st * sy) / spread if spread > 0 else 0.0
        intercept = (sy - slope * st) / k
        sse = syy + slope * slope * stt + k * intercept * intercept - 2 * slope * sty - 2 * intercept * sy \
            + 2 * slope * intercept * st
        noise = math.sqrt(max(0.0, sse) / max(1, k - 2))
        t0, y0, mean, sxx = self.t0, self.y0, st / k, spread / k

        def scatter(t: float) -> float:
            lever = (t - t0 - mean) ** 2 / sxx if sxx > 0 else 0.0
            return noise * math.sqrt(1 + 1 / k + lever)

        return (lambda t: y0 + intercept + slope * (t - t0)), scatter


def _fit(points: Sequence[Reading], jump: Jump | None) -> Trend:
    ts = [r.t for r in points]
    ys = [float(r.used) for r in points]
    slope, intercept = statistics.linear_regression(ts, ys)
    r2 = _r_squared(ts, ys)
    residuals = [y - (slope * t + intercept) for t, y in zip(ts, ys, strict=True)]
    noise = math.sqrt(sum(e * e for e in residuals) / max(1, len(points) - 2))
    steps = [float(r.step) for r in points if r.step is not None]
    per_step = steps_r2 = covered = None
    if len(steps) == len(points):
        covered = int(steps[-1] - steps[0])  # 0: the steps stood still while memory moved
        if covered > 0:
            per_step = statistics.linear_regression(steps, ys)[0]
            steps_r2 = _r_squared(ts, steps)
    return Trend(slope, per_step, r2, len(points), ts[-1] - ts[0], covered,
                 int(slope * ts[0] + intercept), int(slope * ts[-1] + intercept), steps_r2,
                 ts[-1], noise, jump)


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


# When a steady rise will reach the limit, and whether to restart at the next checkpoint before it does.
#
# While an attempt runs, ``forecast`` extends the line through its memory readings (``trend.py``) to
# the limit that applies (the cgroup's, ``--memory-limit``, the GPU's capacity) and compares the
# time left with the checkpoint rhythm. The line and its distance to the limit are ``trend.Headroom``,
# the same model the attribution measures a failure with: what status forecast before a failure and
# what the report says after it come from one line.
#
# - the limit comes before the next checkpoint is due: ``CHECKPOINT_NOW`` (ask the worker for one,
#   then restart right after it lands);
# - it comes before the checkpoint after that: ``RESTART_AT_NEXT`` (the next checkpoint is the last
#   one before the limit: restart right after it, nothing is redone and no kernel kill happens);
# - else ``WATCH``: show the forecast, do nothing yet.
#
# A leak rate already measured in an earlier attempt of the run (``prior_per_s``) stands in until
# this attempt has enough readings of its own, so a known leak is caught from the first minutes.
# Pure: the loop feeds it readings and carries out what it returns.


# Room left for what the forecast cannot see: the restart itself, a checkpoint that takes a while
# to write and settle, and the error of a line fitted to a few readings.
MARGIN_S = 3.0
MARGIN_FRACTION = 0.15


ALLOCATOR = "allocator"  # the budget of the probe's step peaks against the allocator's limit


class Move(enum.Enum):
    WATCH = "watch"
    RESTART_AT_NEXT = "restart_at_next_checkpoint"
    CHECKPOINT_NOW = "checkpoint_now"


@dataclass(frozen=True)
class Budget:
    """A limit and the memory counted against it, e.g. ("cgroup", working set, target)."""

    name: str
    used: int
    limit: int  # the forecast's target (the --soft-threshold share)
    hard: int = 0  # the limit itself, where a failure happens (0: the same as ``limit``)

    @property
    def applies(self) -> int:
        return self.hard or self.limit


@dataclass(frozen=True)
class Forecast:
    seconds_to_limit: float
    per_s: float  # bytes per second
    budget: str
    limit: int
    move: Move
    measured: bool  # False: the rate is the one an earlier attempt measured

    @property
    def text(self) -> str:
        """``limit in ~12 min at this rate`` for status, the dashboard and the status line."""
        return (f"{self.budget} limit in ~{_eta(self.seconds_to_limit)} at this rate "
                f"(+{self.per_s / 1e6:.1f} MB/s{'' if self.measured else ', rate from an earlier attempt'})")


def forecast(readings: Sequence[Reading], budget: Budget, next_checkpoint_in: float | None,
             checkpoint_period: float | None, prior_per_s: float | None = None) -> Forecast | None:
    """The forecast for one budget, or None when memory is not rising steadily."""
    trend = steady_rise(readings)
    if trend is not None and trend.steady():
        measured, rate = True, trend.per_s
        left = Headroom(budget.name, budget.limit, trend, readings[-1].t).seconds
    elif trend is None and prior_per_s is not None and prior_per_s > 0 and readings:
        # Too early in this attempt for its own line; the leak is known: its rate from where memory is now.
        measured, rate = False, prior_per_s
        left = max(0.0, (budget.limit - budget.used) / rate)
    else:
        return None
    margin = MARGIN_S + MARGIN_FRACTION * left
    if next_checkpoint_in is None or checkpoint_period is None:
        move = Move.CHECKPOINT_NOW if left <= 2 * margin else Move.WATCH
    elif left <= next_checkpoint_in + margin:
        move = Move.CHECKPOINT_NOW
    elif left <= next_checkpoint_in + checkpoint_period + margin:
        move = Move.RESTART_AT_NEXT
    else:
        move = Move.WATCH
    return Forecast(left, rate, budget.name, budget.limit, move, measured)


def budgets(sample: MemorySample, memory_limit: int | None, fraction: float,
            allocator: tuple[int, int] | None = None) -> list[Budget]:
    """The limits that apply now, each with the memory counted against it (a cgroup's: everything in
    the cgroup that sets it). The target is the ``--soft-threshold`` share of each: room for what the
    line cannot see. ``allocator``: the probe's newest step peak and the allocator's limit."""
    found = [(ALLOCATOR, *allocator)] if allocator is not None else []
    if sample.gpus:
        busiest = max(sample.gpus, key=lambda g: g.used_bytes)
        found.append(("GPU", busiest.used_bytes, busiest.total_bytes))
    if memory_limit and sample.worker_rss_bytes is not None:
        found.append(("--memory-limit", sample.worker_rss_bytes, memory_limit))
    if sample.cgroup and sample.cgroup.limit_bytes:
        found.append(("cgroup", sample.cgroup.counted_bytes, sample.cgroup.limit_bytes))
    return [Budget(name, used, int(limit * fraction), limit) for name, used, limit in found]


def soonest(forecasts: Sequence[Forecast | None]) -> Forecast | None:
    """Of the forecasts for each budget, the one whose limit comes first."""
    found = [f for f in forecasts if f is not None]
    return min(found, key=lambda f: f.seconds_to_limit) if found else None


def _eta(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
