"""Pins for the survivors of mutation testing in sizing/tuning.py (docs/mutation.md): the size
``--predict-shrink`` restarts at, the reason's figures, the floor and the proven size as its bounds,
and which of the policy's decisions the jump changes."""

from __future__ import annotations

from dataclasses import replace

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.sizing import tuning as extrapolate
from oomguard.supervisor.sizing.memmodel import OomFigures, Point, Prediction

MB = 2**20
EARLY = OomFigures(64, 20 * MB, 160 * MB, 180 * MB, 100 * MB, 0.25)  # 80 MB past the fixed a quarter in


def test_the_reason_gives_every_figure_of_the_prediction() -> None:
    assert extrapolate.predict_after_oom(EARLY, 32, 64, 0.1, 1) == Prediction(
        4, 140 * MB,
        "prediction beyond proof: at micro-batch 64 the OOM came 25% through the forward holding 167772160 B "
        "(fixed 104857600 B) and asking 20971520 B more: 1.05e+07 B/sample for a whole step (twice the forward), "
        "so micro-batch 4, predicted to need 1.47e+08 B under the budget 1.7e+08 B "
        "(the proven path would try 32; the next attempt checks it, --grow climbs back)")


def test_a_size_predicted_at_exactly_the_budget_is_taken() -> None:
    # 32 MB past the fixed 100 MB half through the forward at 64: 2.5 MB a sample for a step, so 4
    # needs exactly the 110 MB limit (no margin); 8 would need 120 MB.
    oom = OomFigures(64, 8 * MB, 132 * MB, 110 * MB, 100 * MB, 0.5)
    p = extrapolate.predict_after_oom(oom, 32, 64, 0.0, 1)
    assert p is not None and (p.micro_batch, p.predicted_peak) == (4, 110 * MB)


def test_a_predicted_size_at_the_floor_is_named_as_the_prediction_not_the_floor() -> None:
    p = extrapolate.predict_after_oom(EARLY, 32, 64, 0.1, 4)
    assert p is not None and p.micro_batch == 4
    assert "so micro-batch 4, predicted to need 1.47e+08 B under" in p.reason and "--min-micro-batch" not in p.reason
    floor = extrapolate.predict_after_oom(EARLY, 32, 64, 0.1, 8)
    assert floor is not None and floor.micro_batch == 8 and floor.predicted_peak == 180 * MB
    assert "so --min-micro-batch 8 (nothing at or above it is predicted to fit) under the budget" in floor.reason


def test_a_floor_that_would_break_the_global_batch_is_no_prediction() -> None:
    # Nothing is predicted to fit, and --min-micro-batch 3 does not divide 64: the proven path goes on.
    hopeless = OomFigures(64, 20 * MB, 160 * MB, 180 * MB, 100 * MB, 0.01)
    assert extrapolate.predict_after_oom(hopeless, 32, 64, 0.1, 3) is None
    assert extrapolate.predict_after_oom(hopeless, 32, 64, 0.1, 4) is not None


def test_an_earlier_failure_below_the_failed_size_bounds_the_prediction() -> None:
    # The backward OOM at 64 predicts 16 fits (1.8 MB a sample), but 16 already failed: 8.
    late = OomFigures(64, 55 * MB, 160 * MB, 180 * MB, 100 * MB, 1.0)
    p = extrapolate.predict_after_oom(late, 32, 64, 0.1, 1, [Point(16, None, False)])
    assert p is not None and p.micro_batch == 8
    assert "at micro-batch 64 the OOM came after the forward had returned holding" in p.reason
    assert "a whole step, so micro-batch 8" in p.reason  # a backward OOM is not doubled


def test_one_sample_and_one_byte_of_fixed_memory_are_figures() -> None:
    one = OomFigures(1, 1 * MB, 3 * MB, 3 * MB, 1, 0.5)
    assert extrapolate.per_sample(one) == 2 * (4 * MB - 1) / 0.5


def test_the_jump_reason_is_the_policy_s_then_the_prediction_s_then_the_plan() -> None:
    plan = Plan(BatchPlan(64, 64))
    shrink = decide(Failure(1, FailureKind.HOST_OOM, 64), [], plan, PolicyConfig())
    prediction = Prediction(4, 1.0, "predicted")
    jumped = extrapolate.jump(shrink, 64, prediction)
    assert jumped.reason == f"{shrink.reason}; predicted: micro-batch 4 × accumulation 16 × world 1 = 64"
    assert (jumped.action, jumped.delay) == (shrink.action, shrink.delay)


def test_the_jump_leaves_a_give_up_an_equal_size_and_a_size_the_plan_cannot_run() -> None:
    plan = Plan(BatchPlan(64, 64))
    shrink = decide(Failure(1, FailureKind.HOST_OOM, 64), [], plan, PolicyConfig())
    assert extrapolate.jump(shrink, 64, Prediction(32, 1.0, "same")) is shrink
    give_up = replace(shrink, action=Action.GIVE_UP)  # e.g. at the floor with nothing left
    assert extrapolate.jump(give_up, 64, Prediction(4, 1.0, "predicted")) is give_up
    assert extrapolate.jump(shrink, 64, Prediction(3, 1.0, "not a divisor")) is shrink


def test_nothing_held_past_the_fixed_memory_is_no_figure_but_one_byte_is() -> None:
    assert extrapolate.per_sample(OomFigures(64, 20 * MB, 80 * MB, 180 * MB, 100 * MB, 0.5)) is None
    assert extrapolate.per_sample(OomFigures(64, 20 * MB + 1, 80 * MB, 180 * MB, 100 * MB, 0.5)) == 2 / 0.5 / 64
