"""The memory model: fitting, shrinking after an OOM, growing, and the issue's 96/40 scenario."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from oomguard.common.batch import divisors
from oomguard.supervisor.sizing.memmodel import Point, fit, propose_growth, shrink_after_oom

CAPACITY = 100_000  # bytes of a pretend device; the model is unit-free


def test_divisors() -> None:
    assert divisors(96) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    assert divisors(1) == [1] and divisors(49) == [1, 7, 49]


def test_one_point_assumes_no_fixed_memory() -> None:
    model = fit([Point(24, 48_000, True), Point(48, 100_000, False)])
    assert model is not None and model.fixed_bytes == 0 and model.per_sample_bytes == 2_000
    assert model.predict(32) == 64_000


def test_two_points_fit_the_line_and_keep_the_worst_peak() -> None:
    model = fit([Point(8, 20_000, True), Point(16, 30_000, True), Point(16, 29_000, True)])
    assert model is not None and model.points == 2
    assert model.fixed_bytes == pytest.approx(10_000) and model.per_sample_bytes == pytest.approx(1_250)


def test_noisy_points_never_under_predict() -> None:
    points = [Point(8, 21_000, True), Point(12, 24_000, True), Point(16, 29_500, True)]
    model = fit(points)
    assert model is not None
    assert all(model.predict(p.micro_batch) >= (p.peak_bytes or 0) - 1e-6 for p in points)


def test_negative_intercept_falls_back_to_no_fixed_memory() -> None:
    model = fit([Point(8, 8_000, True), Point(16, 40_000, True)])
    assert model is not None and model.fixed_bytes == 0 and model.per_sample_bytes == 2_500


def test_no_success_means_no_model() -> None:
    assert fit([Point(96, 100_000, False)]) is None and fit([Point(8, None, True)]) is None


def test_shrink_without_successes_halves() -> None:
    pick = shrink_after_oom([], 96, 96, CAPACITY)
    assert pick is not None and pick.micro_batch == 48 and pick.predicted_peak is None


def test_shrink_with_one_success_stays_at_half() -> None:
    # 12 ran at 24 % of capacity: alone that predicts 32 fits, but one point cannot justify > 96/2.
    points = [Point(12, 24_000, True), Point(96, CAPACITY, False)]
    pick = shrink_after_oom(points, 96, 96, CAPACITY)
    assert pick is not None and pick.micro_batch == 32  # 48 predicted 96 000 > 90 000
    assert "from one size" in pick.reason


def test_shrink_with_two_successes_may_skip_above_half() -> None:
    points = [Point(4, 14_000, True), Point(8, 18_000, True)]  # 10 000 + 1 000 / sample
    pick = shrink_after_oom([*points, Point(96, CAPACITY, False)], 96, 96, CAPACITY)
    assert pick is not None and pick.micro_batch == 48 and pick.predicted_peak == pytest.approx(58_000)
    pick = shrink_after_oom([*points, Point(64, CAPACITY, False)], 64, 128, CAPACITY)
    assert pick is not None and pick.micro_batch == 32  # above 64/2 is fine, at or above 64 never


def test_shrink_jumps_below_half_when_half_cannot_fit() -> None:
    points = [Point(24, 60_000, True), Point(32, 78_000, True)]  # 6 000 + 2 250 / sample
    pick = shrink_after_oom([*points, Point(48, CAPACITY, False)], 48, 96, CAPACITY)
    assert pick is not None and pick.micro_batch == 32


def test_shrink_never_picks_a_size_that_failed() -> None:
    points = [Point(2, 4_000, True), Point(4, 6_000, True), Point(24, CAPACITY, False)]
    pick = shrink_after_oom(points, 48, 96, CAPACITY)
    assert pick is not None and pick.micro_batch < 24


def test_shrink_at_the_floor_is_none() -> None:
    assert shrink_after_oom([], 8, 96, CAPACITY, min_micro=8) is None
    assert shrink_after_oom([], 1, 96, CAPACITY) is None


def test_growth_needs_a_model_and_room() -> None:
    assert propose_growth([], 24, 96, CAPACITY) is None
    assert propose_growth([Point(24, 80_000, True)], 24, 96, CAPACITY) is None
    grow = propose_growth([Point(24, 48_000, True), Point(48, CAPACITY, False)], 24, 96, CAPACITY)
    assert grow is not None and grow.micro_batch == 32  # 48 failed once: never again
    doubling = propose_growth(
        [Point(24, 48_000, True), Point(48, CAPACITY, False)], 24, 96, CAPACITY, min_factor=2
    )
    assert doubling is None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="margin"):
        shrink_after_oom([], 8, 96, CAPACITY, margin=1.0)
    with pytest.raises(ValueError, match="micro_batch"):
        Point(0, None, True)


# --- the scenario -----------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    final: int
    failures: int
    tried: tuple[int, ...]


def simulate(peak: Callable[[int], int], start: int, batch: int, use_model: bool, grow: bool) -> Outcome:
    """Drive the model as the supervisor would: run, OOM or succeed, shrink, optionally grow."""
    micro, points, tried = start, [], []
    for _ in range(20):
        tried.append(micro)
        if peak(micro) > CAPACITY:
            points.append(Point(micro, CAPACITY, False))  # at an OOM the device is full
            pick = shrink_after_oom(points, micro, batch, CAPACITY) if use_model else halve(micro, batch)
            assert pick is not None
            micro = pick if isinstance(pick, int) else pick.micro_batch
            continue
        points.append(Point(micro, peak(micro), True))
        grown = propose_growth(points, micro, batch, CAPACITY) if grow else None
        if grown is None:
            break
        micro = grown.micro_batch
    return Outcome(micro, sum(not p.succeeded for p in points), tuple(tried))


def halve(failed: int, batch: int) -> int:
    return max(d for d in divisors(batch) if d <= failed // 2)


def linear(fixed: int, per_sample: int) -> Callable[[int], int]:
    return lambda micro: fixed + per_sample * micro


def test_scenario_96_where_40_fits() -> None:
    peak = linear(8_000, 2_300)  # 40 -> 100 000 fits exactly, 41 -> 102 300 does not
    assert peak(40) <= CAPACITY < peak(41)
    halving = simulate(peak, 96, 96, use_model=False, grow=False)
    assert halving == Outcome(24, 2, (96, 48, 24))
    model = simulate(peak, 96, 96, use_model=True, grow=True)
    assert model.final == 32 and model.failures <= halving.failures
    assert model.tried == (96, 48, 24, 32)


def test_model_never_does_worse_than_halving_on_linear_curves() -> None:
    # Any curve with non-negative fixed memory: one-point predictions over-estimate, so growth and
    # shrinking never add a failure, and the run never ends below where halving ends.
    for batch, fixed_pct, largest_fit in itertools.product(
        (64, 96, 128, 120), (0, 5, 20, 40), range(2, 120, 7)
    ):
        fixed = CAPACITY * fixed_pct // 100
        per_sample = (CAPACITY - fixed) // largest_fit
        peak = linear(fixed, per_sample)
        if peak(1) > CAPACITY or largest_fit >= batch:
            continue
        halving = simulate(peak, batch, batch, use_model=False, grow=False)
        model = simulate(peak, batch, batch, use_model=True, grow=True)
        assert model.failures <= halving.failures, (batch, fixed_pct, largest_fit)
        assert halving.final <= model.final <= largest_fit, (batch, fixed_pct, largest_fit)
