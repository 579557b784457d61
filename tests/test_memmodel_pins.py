"""The memory model's proposals with their reasons, at their boundaries (docs/mutation.md: the
survivors these pin): each Prediction is compared whole, size, predicted peak and reason."""

from __future__ import annotations

import pytest

from oomguard.supervisor.decide.memmodel import Point, Prediction, propose_growth, shrink_after_oom

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
