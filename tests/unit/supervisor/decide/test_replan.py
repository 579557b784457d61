"""Every change of the plan (decide/replan.py) carries its plan, its source and its reason, as the
journal's plan_change events show them; pinned where mutation testing (bench/mutation.py) found
only some of the three checked."""

from __future__ import annotations

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide import replan
from oomguard.supervisor.decide.policy import Action, Decision, Plan
from oomguard.supervisor.decide.replan import PlanChange, Source

PLAN = Plan(BatchPlan(16, 64, 1))


def test_each_change_is_its_plan_its_source_and_its_reason() -> None:
    halved = Plan(BatchPlan(8, 64, 1))
    assert replan.after_failure(Decision(Action.RESTART, halved, "why")) == PlanChange(halved, Source.DECISION, "why")
    assert replan.continue_saved(PLAN, halved.as_dict()) == PlanChange(
        halved, Source.SAVED, "continuing the saved plan at micro-batch 8")
    assert replan.start_at_fitted(PLAN, 8, "job abc") == PlanChange(
        halved, Source.FIT_STORE, "an earlier run of this job fitted micro-batch 8 (job abc)")
    assert replan.grow(halved, 16) == PlanChange(PLAN, Source.GROW, "grow: micro-batch 8 -> 16 × accumulation 4")
    assert replan.planned_restart(PLAN, "leak forecast") == PlanChange(
        PLAN, Source.PLANNED_RESTART, "leak forecast; restarting at micro-batch 16")
    assert replan.allocator_from_environment(PLAN, True) == PlanChange(
        Plan(PLAN.batch, expandable_segments=True), Source.ALLOCATOR,
        "expandable_segments:True is already in the environment")
    assert replan.agreed(PLAN, halved) == PlanChange(
        halved, Source.AGREED, "the nodes' shared plan for this round: micro-batch 8 × accumulation 8 × world 1 = 64")


def test_a_fitted_start_on_a_gpu_says_it_turns_expandable_segments_on() -> None:
    change = replan.start_at_fitted(PLAN, 8, "job abc", gpu=True)
    assert change is not None and change.plan.expandable_segments
    assert change.reason == "an earlier run of this job fitted micro-batch 8 with expandable_segments:True (job abc)"
