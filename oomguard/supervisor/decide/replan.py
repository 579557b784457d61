"""Every change of the run's plan, as a pure function that returns the new plan with its reason.

A failure's change comes from ``policy.decide``; the others come from here: continuing a run an
earlier supervisor left, the fit store's starting size, ``--grow``, a planned restart, allocator
settings the user already gave, and node 0's plan on the other nodes. The loop applies a
``PlanChange`` in one place, which journals it (``plan_change`` events), so every plan an attempt
ran with can be traced to one of these and its reason.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from oomguard.supervisor.decide.policy import Decision, Plan


class Source(enum.Enum):
    SAVED = "saved"  # the plan an earlier supervisor of this run directory saved
    FIT_STORE = "fit_store"  # an earlier run of the same job fitted a size
    DECISION = "decision"  # the policy, after a failure
    GROW = "grow"  # --grow, after a stable stretch and a checkpoint
    PLANNED_RESTART = "planned_restart"  # the memory forecast: same plan, fresh process
    ALLOCATOR = "allocator"  # expandable_segments was already in the user's environment
    AGREED = "agreed"  # several nodes: node 0's plan for this round


@dataclass(frozen=True)
class PlanChange:
    plan: Plan
    source: Source
    reason: str


def continue_saved(plan: Plan, saved: Mapping[str, Any] | None) -> PlanChange | None:
    """The plan an earlier supervisor saved for this run directory, when it is the same job."""
    resumed = plan.resumed(saved)
    if resumed is None:
        return None
    return PlanChange(resumed, Source.SAVED, f"continuing the saved plan at micro-batch {resumed.batch.micro_batch}")


def start_at_fitted(plan: Plan, micro_batch: int | None, job: str, gpu: bool = False) -> PlanChange | None:
    """A fresh run starts where an earlier run of the same job settled (``decide.fitstore``).

    On a GPU it also starts with ``expandable_segments:True``: the store only lowers the start
    after a failure, and after a CUDA OOM the policy always turns it on, so the size was measured
    to fit with it (without it the same size can fragment and fail once more)."""
    if micro_batch is None or micro_batch == plan.batch.micro_batch:
        return None
    new = replace(plan, batch=plan.batch.with_micro_batch(micro_batch),
                  expandable_segments=plan.expandable_segments or gpu)
    also = " with expandable_segments:True" if new.expandable_segments and not plan.expandable_segments else ""
    return PlanChange(new, Source.FIT_STORE,
                      f"an earlier run of this job fitted micro-batch {micro_batch}{also} ({job})")


def after_failure(decision: Decision) -> PlanChange:
    return PlanChange(decision.plan, Source.DECISION, decision.reason)


def grow(plan: Plan, micro_batch: int, why: str = "grow") -> PlanChange:
    """--grow (or a fit measured for another model): a larger micro-batch, the global batch kept
    (accumulation follows)."""
    bigger = replace(plan, batch=plan.batch.with_micro_batch(micro_batch))
    return PlanChange(bigger, Source.GROW, f"{why}: micro-batch {plan.batch.micro_batch} -> {micro_batch} × "
                      f"accumulation {bigger.batch.grad_accum}")


def planned_restart(plan: Plan, reason: str) -> PlanChange:
    """The forecast's restart right after a checkpoint: the batch is not to blame, the plan stays."""
    return PlanChange(plan, Source.PLANNED_RESTART, f"{reason}; restarting at micro-batch {plan.batch.micro_batch}")


def allocator_from_environment(plan: Plan, expandable_in_env: bool) -> PlanChange | None:
    """The user's own PYTORCH_CUDA_ALLOC_CONF already has expandable_segments:True: the policy must
    not spend a restart "trying" it after an OOM."""
    if plan.expandable_segments or not expandable_in_env:
        return None
    return PlanChange(replace(plan, expandable_segments=True), Source.ALLOCATOR,
                      "expandable_segments:True is already in the environment")


def agreed(plan: Plan, node0: Plan) -> PlanChange | None:
    """Several nodes: every node runs node 0's plan for the round."""
    if node0 == plan:
        return None
    return PlanChange(node0, Source.AGREED, f"the nodes' shared plan for this round: {node0.batch.describe()}")
