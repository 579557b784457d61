"""The memory model: fitting, shrinking after an OOM, growing, and the issue's 96/40 scenario."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from oomguard.supervisor.sizing.memmodel import (
    Fit,
    OomFigures,
    Point,
    Prediction,
    budget,
    divisors,
    fit,
    propose_growth,
    shrink_after_oom,
    unfit,
)

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


# --- merged from tests/test_memmodel_pins.py ----------------------------------------------------------------
# The memory model's proposals with their reasons, at their boundaries (docs/mutation.md: the
# survivors these pin): each Prediction is compared whole, size, predicted peak and reason.


GIB = 2**30
TWO_SIZES = [Point(8, 6 * GIB, True), Point(16, 10 * GIB, True)]  # 2 GiB fixed + 0.5 GiB a sample


def test_shrinking_without_a_success_takes_the_largest_divisor_at_half() -> None:
    assert shrink_after_oom([], 64, 64, 80 * GIB, 0.1, 1) == Prediction(
        32, None, "no successful attempt yet: largest divisor <= 64/2")


def test_one_size_caps_the_shrink_at_half_and_fits_at_exactly_the_budget() -> None:
    """8 GiB at 8: 1 GiB a sample; 32 needs 32 GiB, exactly the 32 GiB budget (no margin)."""
    assert shrink_after_oom([Point(8, 8 * GIB, True)], 64, 64, 32 * GIB, 0.0, 1) == Prediction(
        32, 32 * GIB, "model: 1.07e+09 B/sample from one size, no fixed memory assumed; budget 3.44e+10 B, "
        "at most 64/2")


def test_two_sizes_name_the_line_and_nothing_that_fits_tries_the_smallest() -> None:
    assert shrink_after_oom(TWO_SIZES, 64, 64, 80 * GIB, 0.1, 1) == Prediction(
        32, 18 * GIB, "model: fixed 2.15e+09 B + 5.37e+08 B/sample from 2 sizes; budget 7.73e+10 B")
    heavy = [Point(8, 70 * GIB, True), Point(16, 75 * GIB, True)]  # 65 GiB fixed
    assert shrink_after_oom(heavy, 32, 64, 64 * GIB, 0.1, 2) == Prediction(
        2, 66.25 * GIB, "model predicts nothing fits under 6.18e+10 B; trying the smallest")


def test_growth_fits_at_exactly_the_budget_and_names_the_line() -> None:
    assert propose_growth([Point(8, 8 * GIB, True)], 8, 64, 64 * GIB, 0.0) == Prediction(
        64, 64 * GIB, "model: 1.07e+09 B/sample from one size, no fixed memory assumed; budget 6.87e+10 B")
    assert propose_growth(TWO_SIZES, 16, 64, 80 * GIB, 0.1) == Prediction(
        64, 34 * GIB, "model: fixed 2.15e+09 B + 5.37e+08 B/sample from 2 sizes; budget 7.73e+10 B")


def test_growth_stays_below_every_size_that_failed() -> None:
    """A failure at 16 with a per-process batch of 30: 15 is the largest divisor below it."""
    grown = propose_growth([Point(5, 5 * GIB, True), Point(16, None, False)], 5, 30, 80 * GIB, 0.1)
    assert grown is not None and grown.micro_batch == 15
    capped = propose_growth([Point(8, 6 * GIB, True), Point(32, None, False)], 8, 64, 80 * GIB, 0.1)
    assert capped is not None and capped.micro_batch == 16


def test_the_smallest_batch_and_capacity_are_valid_zero_is_refused() -> None:
    assert propose_growth([Point(1, GIB, True)], 1, 1, 1, 0.0) is None  # nothing larger than 1 to grow to
    with pytest.raises(ValueError, match="^per-process batch must be >= 1, got 0$"):
        propose_growth(TWO_SIZES, 16, 0, 80 * GIB)
    with pytest.raises(ValueError, match="^capacity must be positive, got 0$"):
        propose_growth(TWO_SIZES, 16, 64, 0)


def test_a_line_that_falls_between_two_sizes_is_replaced_by_the_safe_line_of_both() -> None:
    """Noise between close sizes (10 GiB at 8, 9 GiB at 16): no fixed memory, the larger share per
    sample (1.25 GiB at 8), still a line through two sizes, so no cap at half the failed size."""
    noisy = [Point(8, 10 * GIB, True), Point(16, 9 * GIB, True)]
    assert shrink_after_oom(noisy, 64, 64, 80 * GIB, 0.1, 1) == Prediction(
        32, 40 * GIB, "model: fixed 0 B + 1.34e+09 B/sample from 2 sizes; budget 7.73e+10 B")


def test_growth_takes_the_next_divisor_up() -> None:
    """From 8 with a per-process batch of 72, only 9 fits (1 GiB a sample, 9.5 GiB of budget)."""
    assert propose_growth([Point(8, 8 * GIB, True)], 8, 72, 10 * GIB, 0.05) == Prediction(
        9, 9 * GIB, "model: 1.07e+09 B/sample from one size, no fixed memory assumed; budget 1.02e+10 B")


# --predict-shrink's changes: a measured fixed memory and, under RLIMIT_AS, a floor the margin leaves alone.

def test_the_budget_takes_the_margin_of_the_room_above_the_floor() -> None:
    assert budget(100, 0.5) == 50  # no floor: the capacity less its margin
    assert budget(100, 0.5, 60) == 80


def test_a_measured_fixed_memory_counts_only_below_the_smallest_peak() -> None:
    one = [Point(4, 100, True)]
    assert fit(one, 1) == Fit(1, 24.75, 1)  # a byte is a measurement
    assert fit(one, 100) == Fit(0.0, 25.0, 1)  # all of the peak: no per-sample memory left, so not believed
    assert fit(one, 150) == Fit(0.0, 25.0, 1)
    # A falling line is replaced by the safe line through the fixed memory: (10 - 2) GiB over 8 at most.
    assert fit([Point(8, 10 * GIB, True), Point(16, 9 * GIB, True)], 2 * GIB) == Fit(2 * GIB, GIB, 2)


def test_the_shrink_uses_the_fixed_memory_and_names_it() -> None:
    # 10 GiB at 8 with 6 GiB fixed: 0.5 GiB a sample, so 32 (22 GiB) fits the 32 GiB; without it 16.
    # The reason says the probe measured it, not when: the tuner takes what the worker held before
    # its first forward, or after its first optimizer step once the probe read that.
    one = [Point(8, 10 * GIB, True)]
    assert shrink_after_oom(one, 64, 64, 32 * GIB, 0.0, 1, fixed_bytes=6 * GIB) == Prediction(
        32, 22 * GIB, "model: 5.37e+08 B/sample from one size, fixed 6.44e+09 B measured by the probe; "
        "budget 3.44e+10 B, at most 64/2")
    assert shrink_after_oom(one, 64, 64, 32 * GIB, 0.0, 1).micro_batch == 16  # type: ignore[union-attr]


def test_under_a_floor_the_shrink_and_the_growth_keep_the_margin_off_it() -> None:
    # 40 GiB with 6 GiB mapped below the forward: half the room above it is 23 GiB, enough for 32
    # (22 GiB); half of the whole 40 GiB (20 GiB) is not.
    one = [Point(8, 10 * GIB, True)]
    with_floor = shrink_after_oom(one, 64, 64, 40 * GIB, 0.5, 1, fixed_bytes=6 * GIB, floor=6 * GIB)
    assert with_floor is not None and with_floor.micro_batch == 32 and "budget 2.47e+10 B" in with_floor.reason
    assert shrink_after_oom(one, 64, 64, 40 * GIB, 0.5, 1, fixed_bytes=6 * GIB).micro_batch == 16  # type: ignore[union-attr]
    grow = propose_growth(one, 8, 64, 40 * GIB, 0.5, fixed_bytes=6 * GIB, floor=6 * GIB)
    assert grow is not None and grow.micro_batch == 32
    assert propose_growth(one, 8, 64, 40 * GIB, 0.5, fixed_bytes=6 * GIB).micro_batch == 16  # type: ignore[union-attr]


def test_a_bound_exactly_at_the_limit_proves_nothing() -> None:
    # 64 GiB held and asked at 64 scale to exactly the 32 GiB limit at 32: it may still fit.
    oom = OomFigures(64, 32 * GIB, 32 * GIB, 32 * GIB)
    assert oom.need_at(32) == 32 * GIB and not oom.proves_unfit(32) and unfit(32, [], oom) is None
    assert oom.proves_unfit(33)


def test_the_safe_line_replaces_a_fit_only_past_its_edges() -> None:
    # A line through the origin is believed, even with a measured fixed memory below it: it is the
    # larger prediction (32 GiB at 32, where the safe line through 1 GiB says 28.1 GiB).
    assert fit([Point(8, 8 * GIB, True), Point(16, 16 * GIB, True)], GIB) == Fit(0.0, GIB, 2)
    # A flat line is not (it would predict that any size fits): the safe line through 0 instead.
    assert fit([Point(8, 10 * GIB, True), Point(16, 10 * GIB, True)]) == Fit(0.0, 10 * GIB / 8, 2)
    # One byte a sample is a rise.
    assert fit([Point(8, 10 * GIB, True), Point(16, 10 * GIB + 8, True)]) == Fit(10 * GIB - 8, 1.0, 2)
