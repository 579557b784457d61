"""The memory trend's edges the mutation run found unpinned (docs/mutation.md): when readings are a
jump above the line (the prediction interval of the line before them, and the 2 % floor), which
stretch a jump is judged against, the warm-up and the fall, the leak verdict's boundaries, and the
headroom sentence the cause line shows."""

from __future__ import annotations

import math
import statistics

import pytest

from oomguard.supervisor.observe.cgroup import CgroupMemory
from oomguard.supervisor.observe.gpu import GpuReading
from oomguard.supervisor.observe.sampler import MemorySample
from oomguard.supervisor.sizing.trend import (
    Budget,
    Forecast,
    Headroom,
    Move,
    Reading,
    Trend,
    after_warmup,
    budgets,
    forecast,
    steady_rise,
)

MIB = 2**20
T0 = 5000.0  # a monotonic clock's readings do not start at 0


def stepless(points: list[Reading]) -> list[Reading]:
    """``points`` after the warm-up readings that make ``after_warmup`` keep exactly them."""
    warm = next(w for w in range(2, 100) if max(2, (w + len(points)) // 4) == w)
    readings = [Reading(T0 - 10 - warm + i, points[0].used) for i in range(warm)] + points
    assert after_warmup(readings) == points
    return readings


# Seven readings about a line rising 1 MiB/s from 100 MiB, scattered by a few MiB (σ about 3.9 MiB).
BODY_T = [T0 + i for i in range(7)]
BODY = [Reading(t, 100 * MIB + int((t - T0) * MIB) + e * MIB) for t, e in zip(BODY_T, (3, -4, 2, -1, 4, -3, -1),
                                                                          strict=True)]


def prediction_bound(body: list[Reading], t: float) -> tuple[float, float]:
    """The least-squares line through ``body`` at ``t`` and 3 σ of a new reading's prediction interval
    there, computed the textbook way."""
    ts, ys = [r.t for r in body], [float(r.used) for r in body]
    slope, intercept = statistics.linear_regression(ts, ys)
    k, mean = len(body), statistics.fmean(ts)
    sigma = math.sqrt(sum((y - slope * x - intercept) ** 2 for x, y in zip(ts, ys, strict=True)) / (k - 2))
    sxx = sum((x - mean) ** 2 for x in ts)
    return slope * t + intercept, 3 * sigma * math.sqrt(1 + 1 / k + (t - mean) ** 2 / sxx)


@pytest.mark.parametrize("margin", [1 + 1e-4, 1 - 1e-4])
def test_a_reading_is_a_jump_exactly_past_three_sigma_of_the_prediction_interval(margin: float) -> None:
    t = T0 + 9  # three seconds past the line's readings: the interval widens with the distance
    line, bound = prediction_bound(BODY, t)
    assert bound > 0.02 * (line + bound)  # the noise decides here, not the 2 % floor
    trend = steady_rise(stepless([*BODY, Reading(t, int(line + bound * margin))]))
    assert trend is not None
    if margin > 1:
        assert trend.jump is not None and (trend.jump.readings, trend.jump.t) == (1, t)
        assert trend.jump.above == pytest.approx(bound * margin, abs=16)
        assert trend.readings == 7  # the jump is kept out of the line
    else:
        assert trend.jump is None and trend.readings == 8


def test_above_a_flat_line_the_floor_is_two_percent_of_the_memory_in_use() -> None:
    flat = [Reading(T0 + i, 4_900_000_000) for i in range(7)]
    exactly = steady_rise(stepless([*flat, Reading(T0 + 8, 5_000_000_000)]))  # 10**8 above: 2 % of 5 GB
    assert exactly is not None and exactly.jump is None
    past = steady_rise(stepless([*flat, Reading(T0 + 8, 5_000_000_001)]))
    assert past is not None and past.jump is not None and past.jump.above == 100_000_001
    within = steady_rise(stepless([*flat, Reading(T0 + 8, 4_949_000_000)]))  # 1 % above
    assert within is not None and within.jump is None


def test_a_jump_as_long_as_a_jump_can_be_is_one_though_a_bump_came_before_it() -> None:
    # 16 readings: the last 8 (half) may be a jump. A bump (150, then 125 MiB over a flat 100) comes
    # before them; only a run one reading longer than the longest jump is checked for a new level.
    levels = [100] * 6 + [150, 125] + [400] * 8
    trend = steady_rise(stepless([Reading(T0 + i, y * MIB + i % 2 * 100_000) for i, y in enumerate(levels)]))
    assert trend is not None and trend.jump is not None
    assert (trend.jump.readings, trend.jump.t) == (8, T0 + 8)


def test_a_jump_is_judged_against_the_first_stretch_of_two_seconds() -> None:
    # Readings 0.1 s apart, then one at exactly 2 s: the six span 2 s, enough for a line; the two
    # after them jump. Judged against the first five (0.4 s) or from the second (1.9 s) instead, the
    # jump would bend the line.
    body = [Reading(T0 + i / 10, 100 * MIB + i % 2 * 100_000) for i in range(5)] + [Reading(T0 + 2.0, 100 * MIB)]
    trend = steady_rise(stepless([*body, Reading(T0 + 3, 300 * MIB), Reading(T0 + 4, 300 * MIB)]))
    assert trend is not None and trend.jump is not None
    assert (trend.jump.readings, trend.readings, trend.span_s) == (2, 6, 2.0)


def test_a_line_shorter_than_two_seconds_judges_no_jump_and_a_later_one_still_does() -> None:
    # Six readings 0.1 s apart (0.5 s: too short a line to judge what follows), then readings that
    # climb on: judged against the first six they would be a jump, and the trend would be too short.
    fast = [Reading(T0 + i / 10, 100 * MIB + i % 2 * 100_000) for i in range(6)]
    climb = steady_rise(stepless([*fast, Reading(T0 + 3, 300 * MIB), Reading(T0 + 4, 300 * MIB)]))
    assert climb is not None and climb.jump is None and climb.readings == 8
    # Past the short line, the next one is judged: a flat 3 s and then two readings far above it.
    later = [*fast, Reading(T0 + 3, 100 * MIB), Reading(T0 + 5, 500 * MIB), Reading(T0 + 6, 500 * MIB)]
    jumped = steady_rise(stepless(later))
    assert jumped is not None and jumped.jump is not None and jumped.jump.readings == 2


def test_six_readings_over_exactly_two_seconds_are_a_trend() -> None:
    points = [Reading(T0 + i / 10, 100 * MIB + i * MIB) for i in range(5)] + [Reading(T0 + 2.0, 120 * MIB)]
    trend = steady_rise(stepless(points))
    assert trend is not None and trend.readings == 6 and trend.span_s == 2.0


def test_without_steps_at_least_two_readings_are_warm_up() -> None:
    readings = [Reading(T0 + i, 100 * MIB + i * MIB) for i in range(10)]  # a quarter of 10 is 2
    trend = steady_rise(readings)
    assert trend is not None and trend.readings == 8 and trend.span_s == 7


def test_a_reading_of_nothing_yet_is_no_fall_and_a_fall_to_exactly_80_percent_is_none() -> None:
    # A worker not yet on the GPU reads 0 bytes: it is no memory being freed as the worker dies.
    starting = [Reading(T0, 0)] + [Reading(T0 + i, 100 * MIB + i * MIB) for i in range(1, 8)]
    trend = steady_rise(stepless(starting))
    assert trend is not None and trend.readings == 8
    # 80 % of the highest reading so far is still the worker; below it, the worker is dying.
    down = [Reading(T0 + i, 113 * MIB + 2 * i * MIB) for i in range(7)] + [Reading(T0 + 7, 100 * MIB)]  # 80 % of 125
    trend = steady_rise(stepless(down))
    assert trend is not None and trend.readings == 8


def test_flat_memory_has_no_fit_quality() -> None:
    trend = steady_rise([Reading(T0 + i, 100 * MIB) for i in range(10)])
    assert trend is not None and trend.r2 == 0.0 and not trend.steady()
    assert trend.describe("worker RSS") == "worker RSS showed no steady rise (0 B over 7 s)"  # R² stays in the data


def test_a_stretch_that_covers_one_step_has_a_rate_per_step() -> None:
    # Steps 0 and 1 are warm-up; the fit covers steps 2 to 3.
    readings = [Reading(T0 + i, 100 * MIB + i * 4 * MIB, 0 if i < 2 else (1 if i < 4 else (2 if i < 8 else 3)))
                for i in range(12)]
    trend = steady_rise(readings)
    assert trend is not None and trend.steps == 1 and trend.per_step is not None
    assert trend.per_step == 16 * MIB  # one step is no steady rise (three are): its words say so
    assert trend.describe("worker RSS") == "worker RSS showed no steady rise (28.0 MiB over 7 s)"


def trend(**changes: float | int | None) -> Trend:
    """A steady leak of 1 MiB/s over 60 s and 20 steps, from 200 to 260 MiB; ``changes`` move one edge."""
    fields: dict[str, float | int | None] = {
        "per_s": float(MIB), "per_step": 3.0 * MIB, "r2": 0.99, "readings": 60, "span_s": 60.0, "steps": 20,
        "first": 200 * MIB, "last": 260 * MIB, "steps_r2": 0.99, "t_last": T0 + 60}
    fields.update(changes)
    return Trend(**fields)  # type: ignore[arg-type]


def test_the_leak_verdicts_boundaries_are_steady() -> None:
    assert trend().steady()
    assert trend(r2=0.9).steady()  # R² of exactly 0.9 counts
    assert trend(steps_r2=0.9).steady()
    assert trend(steps=3).steady()  # three steps is enough
    assert trend(steps=None, per_step=None, steps_r2=None, span_s=30.0).steady()  # 30 s without steps
    assert trend(first=100 * MIB, last=116 * MIB).steady()  # a rise of exactly 16 MiB at 116 MiB
    assert not trend(first=100 * MIB, last=116 * MIB - 1).steady()


def test_a_rise_must_be_a_tenth_of_the_memory_in_use() -> None:
    # 50 MiB over 1 GiB is the allocator's caches creeping, not a leak (a tenth would be 102 MiB).
    assert not trend(first=974 * MIB, last=1024 * MIB).steady()
    assert trend(first=920 * MIB, last=1024 * MIB).steady()


def headroom(limit: int, per_step: float | None = 3.0 * MIB) -> Headroom:
    return Headroom("cgroup", limit, trend(per_step=per_step), T0 + 60)  # the line: 260 MiB then


def test_a_line_past_the_limit_says_how_far_past() -> None:
    text = headroom(250 * MIB).describe()
    assert text == ("its steady rise had passed the cgroup limit of 250.0 MiB when it failed (about 260.0 MiB, "
                    "10.0 MiB over)")


def test_a_line_exactly_at_the_limit_is_below_it_and_on_its_way_nowhere() -> None:
    for per_step in (3.0 * MIB, None):
        text = headroom(260 * MIB, per_step).describe()
        assert text == ("its steady rise had reached the cgroup limit of 260.0 MiB when it failed (about 260.0 MiB, "
                        "within the readings' noise)")
        assert headroom(260 * MIB, per_step).seconds == 0 and round(headroom(260 * MIB, per_step).tolerance / MIB) == 5


def test_a_line_one_byte_below_the_limit_says_how_far_away_it_is() -> None:
    """One byte short is within the readings' noise: reached, in words; the byte stays in the figures."""
    assert "had reached the cgroup limit of 260.0 MiB" in headroom(260 * MIB + 1).describe()
    assert headroom(260 * MIB + 1).distance == 1 and headroom(260 * MIB + 1).steps == 1 / (3 * MIB)
    assert headroom(260 * MIB + 1, None).seconds == 1 / MIB


def test_without_steps_the_distance_is_in_seconds() -> None:
    text = headroom(400 * MIB, None).describe()
    assert text == ("its steady rise was at about 260.0 MiB when it failed, 140.0 MiB below the cgroup limit of "
                    "400.0 MiB")
    assert headroom(400 * MIB, None).seconds == 140.0  # "~140 s at this rate": in the journal's figures, not the line


# --- merged from tests/test_forecast_pins.py ----------------------------------------------------------------
# The forecast's budgets, its words for a duration and its moves at their edges (docs/mutation.md:
# the survivors these pin). The rate of an earlier attempt is used where a test needs an exact time
# to the limit: (limit - used) / rate.


GIB = 2**30
EARLY = [Reading(0.0, 0, 0)]  # too few readings for a line of this attempt's own


def gpu(index: int, used: int, total: int = 80 * GIB) -> GpuReading:
    return GpuReading(index, index, f"GPU-{index}", "H100", total, used, total - used, 0, None, ())


def test_every_limit_that_applies_with_the_memory_counted_against_it() -> None:
    cgroup = CgroupMemory("/cg", 2, 9 * GIB, 7 * GIB, 16 * GIB, 0, 8 * GIB)
    sample = MemorySample(0.0, 0.0, 1, 3 * GIB, (1,), 64 * GIB, 32 * GIB, cgroup, None,
                          (gpu(0, 10 * GIB), gpu(1, 30 * GIB, 40 * GIB), gpu(2, 20 * GIB)))
    assert budgets(sample, 12 * GIB, 0.5, allocator=(5 * GIB, 24 * GIB)) == [
        Budget("allocator", 5 * GIB, 12 * GIB, 24 * GIB),
        Budget("GPU", 30 * GIB, 20 * GIB, 40 * GIB),  # the busiest device
        Budget("--memory-limit", 3 * GIB, 6 * GIB, 12 * GIB),
        Budget("cgroup", 8 * GIB, 8 * GIB, 16 * GIB)]
    gone = MemorySample(0.0, 0.0, None, None, (), 64 * GIB, 32 * GIB, None, None)
    assert budgets(gone, 12 * GIB, 0.5) == []  # no worker: nothing counted against --memory-limit


@pytest.mark.parametrize(("seconds", "words"), [
    (89.0, "89 s"), (90.0, "2 min"), (5399.0, "90 min"), (5400.0, "1.5 h"), (9000.0, "2.5 h")])
def test_durations_in_words(seconds: float, words: str) -> None:
    assert Forecast(seconds, 2e6, "cgroup", GIB, Move.WATCH, True).text == (
        f"cgroup limit in ~{words} at this rate (+2.0 MB/s)")


def test_an_earlier_attempts_rate_of_one_byte_a_second_still_forecasts() -> None:
    found = forecast(EARLY, Budget("cgroup", 1000, 1600), None, None, prior_per_s=1.0)
    assert found is not None and found.seconds_to_limit == 600.0 and not found.measured
    assert forecast(EARLY, Budget("cgroup", 1000, 1600), None, None, prior_per_s=0.0) is None
    past = forecast(EARLY, Budget("cgroup", 2000, 1600), None, None, prior_per_s=1.0)
    assert past is not None and past.seconds_to_limit == 0.0


def test_without_a_checkpoint_rhythm_a_checkpoint_is_due_within_twice_the_margin() -> None:
    """The margin is 3 s + 15 % of the time left: at 8 s left twice it is 8.4 s, at 12 s 9.6 s."""
    soon = forecast(EARLY, Budget("cgroup", 0, 800), None, None, prior_per_s=100.0)
    assert soon is not None and soon.move is Move.CHECKPOINT_NOW
    later = forecast(EARLY, Budget("cgroup", 0, 1200), None, None, prior_per_s=100.0)
    assert later is not None and later.move is Move.WATCH
    # the next checkpoint known but not the period between them: still no rhythm to plan by
    known = forecast(EARLY, Budget("cgroup", 0, 1200), 5.0, None, prior_per_s=100.0)
    assert known is not None and known.move is Move.WATCH


def test_each_move_holds_at_its_boundary() -> None:
    """20 s left, so the margin is 3 s + 15 % of 20 s = 6 s exactly: a checkpoint due in 14 s is
    now (14 + 6 = 20); one due in 4 s with 10 s between checkpoints is a restart at the next (4 +
    10 + 6 = 20). Without a rhythm, 6000 bytes at 700 B/s leave exactly twice the margin."""
    twenty = Budget("cgroup", 0, 2000)
    now = forecast(EARLY, twenty, 14.0, 100.0, prior_per_s=100.0)
    assert now is not None and now.seconds_to_limit == 20.0 and now.move is Move.CHECKPOINT_NOW
    at_next = forecast(EARLY, twenty, 4.0, 10.0, prior_per_s=100.0)
    assert at_next is not None and at_next.move is Move.RESTART_AT_NEXT
    edge = forecast(EARLY, Budget("cgroup", 0, 6000), None, None, prior_per_s=700.0)
    assert edge is not None and edge.move is Move.CHECKPOINT_NOW


def test_hours_are_shown_to_a_tenth() -> None:
    assert Forecast(5580.0, 2e6, "GPU", GIB, Move.WATCH, True).text.startswith("GPU limit in ~1.6 h ")
