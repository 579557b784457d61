"""Batch arithmetic (common/batch.py) and the resume check (observe/checkpoints.py) pinned where mutation
testing (bench/mutation.py) found them loose: whole numbers everywhere, the floors, the refusals."""

from __future__ import annotations

import pytest

from oomguard.common.batch import BatchPlan, divisors, largest_divisor_at_most
from oomguard.supervisor.observe.checkpoints import ResumeCheck, ResumeVerdict


def test_divisors_are_whole_numbers() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and all(isinstance(d, int) for d in divisors(12))


def test_one_is_a_divisor_by_default() -> None:
    assert largest_divisor_at_most(7, 1) == 1
    assert BatchPlan(1, 7).largest_at_most(1) == 1


def test_a_plan_that_does_not_divide_is_refused_with_its_figures() -> None:
    with pytest.raises(ValueError, match=r"inexact batch plan BatchPlan\(micro_batch=3"):
        BatchPlan(3, 64, 2)
    with pytest.raises(ValueError, match="a script without accumulation cannot train at"):
        BatchPlan(4, 8, 1, asked_global=32)


def test_a_plan_without_accumulation_shrinks_to_whole_sizes_and_not_below_the_floor() -> None:
    plan = BatchPlan(8, 8, 1, asked_global=32)
    top = plan.largest_at_most(100)
    assert top == 32 and isinstance(top, int)
    assert BatchPlan(4, 4, 1, asked_global=4).largest_at_most(2, floor=3) is None


def test_a_bar_as_long_as_the_checkpoints_step_is_another_bar() -> None:
    check = ResumeCheck("ckpt/step-40", 40)
    check.see(5, 40)
    assert check.verdict is None


def test_a_first_step_of_two_went_back_rather_than_started_over() -> None:
    message = ResumeVerdict("ckpt/step-40", 40, 2).message("hint")
    assert message == "the script went back to step 2, not on from step-40 (step 40): 39 step(s) redone; hint"
