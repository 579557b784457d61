"""The loop's memory of one attempt's trend: its readings per budget, its checkpoint rhythm, the
newest forecast, and whether a checkpoint was asked for because of it.

The decisions are pure (``decide.forecast``, ``decide.attribution``); this object only keeps what
they are fed and what the attempt has already done about them (asked), so a forecast is acted on
once per attempt. The restart it plans is the attempt's one ``Pending`` (``run/attempt.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from oomguard.supervisor.decide.attribution import Attribution, Cause, Evidence, Limit, Plateau, attribute
from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.decide.recovery import Readings
from oomguard.supervisor.observe.sampler import MemorySample
from oomguard.supervisor.sizing.memmodel import Fit
from oomguard.supervisor.sizing.trend import ALLOCATOR, Forecast, Move, Reading, budgets, forecast, soonest, steady_rise

MAX_READINGS = 600  # per budget; past this, every other reading is dropped (the whole attempt stays in view)
HOST = "worker RSS"
MACHINE = "host"  # the machine's memory in use against its total: what a kernel OOM kill without a cgroup limit hit
# Which limit a failure of each kind hit, first choice first: the GPU's capacity, oomguard's own
# --memory-limit (a cgroup limit where one is made, so the cgroup's next), the cgroup's, the machine's.
LIMIT_OF = {
    FailureKind.CUDA_OOM: ("GPU",),
    FailureKind.MEMORY_LIMIT: ("--memory-limit", "cgroup"),
    FailureKind.HOST_OOM: ("cgroup", MACHINE),
}


@dataclass
class TrendWatch:
    prior_per_s: float | None = None  # a leak rate measured earlier in this run
    prior_period: float | None = None  # the checkpoint period seen in earlier attempts
    started: float = 0.0  # monotonic start of the attempt
    series: dict[str, list[Reading]] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)  # each budget's limit itself (not the target), newest
    checkpoint_times: list[float] = field(default_factory=list)  # monotonic, new checkpoints of this attempt
    forecast: Forecast | None = None
    asked: bool = False  # a checkpoint was asked for because of the forecast

    def add(self, sample: MemorySample, step: int | None, memory_limit: int | None,
            fraction: float, allocator: tuple[int, int] | None = None) -> Forecast | None:
        """Fold one sample in and return the forecast for the budget whose limit comes first;
        ``allocator`` is the probe's newest step peak and its limit, where the probe reports them."""
        t = sample.monotonic
        if sample.worker_rss_bytes is not None:
            self._keep(HOST, Reading(t, sample.worker_rss_bytes, step))
        if sample.gpus:
            self._keep("GPU memory", Reading(t, sample.worker_gpu_bytes or 0, step))
        found = budgets(sample, memory_limit, fraction, allocator)
        for budget in found:
            self._keep(budget.name, Reading(t, budget.used, step))
            self.limits[budget.name] = budget.applies
        self._keep(MACHINE, Reading(t, sample.host_total_bytes - sample.host_available_bytes, step))
        self.limits[MACHINE] = sample.host_total_bytes
        next_in, period = self.checkpoint_rhythm(t)
        found_forecast = soonest([forecast(self.series[b.name], b, next_in, period, self.prior_per_s)
                                  for b in found])
        if found_forecast is not None and found_forecast.measured and found_forecast.move is not Move.WATCH \
                and not self.leaking():
            # A cgroup's working set also grows with page cache the kernel reclaims before any OOM
            # kill (a dataset read once): act only when the worker's own memory rises too.
            found_forecast = replace(found_forecast, move=Move.WATCH)
        self.forecast = found_forecast
        return self.forecast

    def _keep(self, name: str, reading: Reading) -> None:
        readings = self.series.setdefault(name, [])
        readings.append(reading)
        if len(readings) > MAX_READINGS:
            self.series[name] = readings[::2]

    def checkpoint_seen(self, now: float) -> None:
        self.checkpoint_times.append(now)

    def checkpoint_rhythm(self, now: float) -> tuple[float | None, float | None]:
        """(seconds until the next checkpoint is due, seconds between checkpoints), from the
        checkpoints this attempt wrote, else those of earlier attempts; (None, None) when unknown."""
        times = self.checkpoint_times
        if len(times) >= 2:
            recent = times[-6:]
            period: float | None = statistics.median([b - a for a, b in zip(recent, recent[1:], strict=False)])
        else:
            period = self.prior_period
        if period is None:
            return None, None
        anchor = times[-1] if times else self.started
        return max(0.0, anchor + period - now), period

    def attribute(self, evidence: Evidence, micro_batch: int, model: Fit | None = None,
                  kind: FailureKind | None = None, failed_at: float | None = None,
                  earlier: Sequence[Plateau] = ()) -> Attribution:
        """The cause of this attempt's memory failure, from the series that matters: the allocator's
        step peaks where the probe reports them, else the GPU's when there is one, else the worker
        tree's RSS; measured against the limit a failure of ``kind`` hit at ``failed_at`` (monotonic),
        or, under RLIMIT_AS, told in the probe's figures at the failure. Without a kind (a planned
        restart) there is no failure for the trend to explain, and the readings are no lower bounds."""
        seen = self.readings(kind, failed_at, evidence)
        return attribute(list(seen.series), evidence, micro_batch, seen.name, model, seen.limit, earlier,
                         failed=kind is not None)

    def planned_restart(self, micro_batch: int) -> Attribution | None:
        """At a planned restart: the leak the readings show (None: none), and its rate kept for the
        next attempt's forecast (the newest forecast's, else the one measured before)."""
        per_s = self.forecast.per_s if self.forecast else self.prior_per_s
        attribution = self.attribute(Evidence(), micro_batch)
        self.prior_per_s = per_s
        return attribution if attribution.cause is Cause.LEAK else None

    def readings(self, kind: FailureKind | None, failed_at: float | None, evidence: Evidence) -> Readings:
        """The series a failure's cause is judged on and the limit it hit (``attribute``'s inputs)."""
        name = self._own()
        # Under RLIMIT_AS the probe names the limit the failure met; the cgroup's or the host's did not apply.
        limit = None if evidence.address_space is not None else self.limit(kind, failed_at, evidence.capacity)
        return Readings(name, tuple(self.series.get(name, [])), limit)

    def limit(self, kind: FailureKind | None, failed_at: float | None = None,
              capacity: int | None = None) -> Limit | None:
        """The limit a failure of ``kind`` hit, with the readings counted against it. A CUDA OOM
        message that allows the process less than the device (a per-process memory fraction, which
        NVML cannot see) names the limit itself: the process's own GPU memory is measured against it.
        Where the probe reports the allocator's step peaks, a CUDA OOM is measured on them, against
        the limit the allocator may reach."""
        if kind is FailureKind.CUDA_OOM and self.series.get(ALLOCATOR) and self.limits.get(ALLOCATOR):
            return Limit(ALLOCATOR, self.limits[ALLOCATOR], self.series[ALLOCATOR], failed_at)
        if kind is FailureKind.CUDA_OOM and capacity and self.series.get("GPU memory"):
            return Limit("process's GPU", capacity, self.series["GPU memory"], failed_at)
        for budget in LIMIT_OF.get(kind, ()) if kind is not None else ():
            if self.series.get(budget) and self.limits.get(budget):
                return Limit(budget, self.limits[budget], self.series[budget], failed_at)
        return None

    def leaking(self) -> bool:
        """Did memory rise steadily in this attempt (its peak is not a per-sample figure)?"""
        trend = steady_rise(self.series.get(self._own(), []))
        return trend is not None and trend.steady()

    def _own(self) -> str:
        """The series of the worker's own memory: the allocator's step peaks where the probe gives
        them (what the model allocated), else NVML's GPU memory of its processes, else its RSS."""
        return next((name for name in (ALLOCATOR, "GPU memory") if self.series.get(name)), HOST)


class ForecastBoard:
    """The forecast in the journal's meta (status, dashboard, status line): rewritten at most every
    ``every`` seconds while it holds, at once when it appears or goes."""

    def __init__(self, set_meta: Callable[..., None], every: float = 5.0) -> None:
        self._set_meta = set_meta
        self.every = every
        self._written = 0.0
        self._shown = False

    def show(self, found: Forecast | None) -> None:
        now = time.monotonic()
        if found is None and not self._shown:
            return
        if found is not None and self._shown and now - self._written < self.every:
            return
        self._written = now
        self._shown = found is not None
        self._set_meta(forecast=None if found is None else {
            "text": found.text, "seconds_to_limit": round(found.seconds_to_limit, 1),
            "bytes_per_s": round(found.per_s), "budget": found.budget, "limit": found.limit,
            "move": found.move.value, "t": time.time()})

    def clear(self) -> None:
        """The attempt's forecast ends with it; the next attempt's first one is shown at once (not
        held back by the last write), since attempts between planned restarts are short."""
        self._shown = False
        self._set_meta(forecast=None)
