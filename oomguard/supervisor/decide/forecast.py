"""When a steady rise will reach the limit, and whether to restart at the next checkpoint before it does.

While an attempt runs, ``forecast`` extends the line through its memory readings (``trend.py``) to
the limit that applies (the cgroup's, ``--memory-limit``, the GPU's capacity) and compares the
time left with the checkpoint rhythm. The line and its distance to the limit are ``trend.Headroom``,
the same model the attribution measures a failure with: what status forecast before a failure and
what the report says after it come from one line.

- the limit comes before the next checkpoint is due: ``CHECKPOINT_NOW`` (ask the worker for one,
  then restart right after it lands);
- it comes before the checkpoint after that: ``RESTART_AT_NEXT`` (the next checkpoint is the last
  one before the limit: restart right after it, nothing is redone and no kernel kill happens);
- else ``WATCH``: show the forecast, do nothing yet.

A leak rate already measured in an earlier attempt of the run (``prior_per_s``) stands in until
this attempt has enough readings of its own, so a known leak is caught from the first minutes.
Pure: the loop feeds it readings and carries out what it returns.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from oomguard.supervisor.decide.trend import Headroom, Reading, steady_rise
from oomguard.supervisor.observe.memory import MemorySample

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
    """A limit and the memory counted against it, e.g. ("cgroup", working set, target): ``limit``
    is the forecast's target (the ``--soft-threshold`` share), ``hard`` the limit itself, where a
    failure happens (0: the same as ``limit``)."""

    name: str
    used: int
    limit: int
    hard: int = 0

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
        return (f"{self.budget} limit in ~{_duration(self.seconds_to_limit)} at this rate "
                f"(+{self.per_s / 1e6:.1f} MB/s{'' if self.measured else ', rate from an earlier attempt'})")


def forecast(readings: Sequence[Reading], budget: Budget, next_checkpoint_in: float | None,
             checkpoint_period: float | None, prior_per_s: float | None = None) -> Forecast | None:
    """The forecast for one budget, or None when memory is not rising steadily.

    ``next_checkpoint_in``: seconds until the worker's next checkpoint is due (None: unknown);
    ``checkpoint_period``: seconds between its checkpoints (None: unknown).
    """
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
    """The limits that apply now, each with the memory counted against it. The target is the
    ``--soft-threshold`` fraction of each limit: room for what the line cannot see (a step's
    transient allocations, the restart itself). A cgroup's limit counts everything in the cgroup
    that sets it (the supervisor too, when oomguard runs inside a limited cgroup), so that cgroup's
    working set is what is compared with it. ``allocator``: the in-process probe's newest step peak
    and the limit the allocator may reach (a per-process fraction's cap, which NVML cannot see)."""
    found = []
    if allocator is not None:
        used, limit = allocator
        found.append(Budget(ALLOCATOR, used, int(limit * fraction), limit))
    if sample.gpus:
        busiest = max(sample.gpus, key=lambda g: g.used_bytes)
        found.append(Budget("GPU", busiest.used_bytes, int(busiest.total_bytes * fraction), busiest.total_bytes))
    if memory_limit and sample.worker_rss_bytes is not None:
        found.append(Budget("--memory-limit", sample.worker_rss_bytes, int(memory_limit * fraction), memory_limit))
    if sample.cgroup and sample.cgroup.limit_bytes:
        found.append(Budget("cgroup", sample.cgroup.counted_bytes, int(sample.cgroup.limit_bytes * fraction),
                            sample.cgroup.limit_bytes))
    return found


def soonest(forecasts: Sequence[Forecast | None]) -> Forecast | None:
    """Of the forecasts for each budget, the one whose limit comes first."""
    found = [f for f in forecasts if f is not None]
    return min(found, key=lambda f: f.seconds_to_limit) if found else None


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
