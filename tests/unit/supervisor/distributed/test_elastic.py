"""The plan for another world size (``dist.elastic``): the global batch asked, exactly, or one line
saying why no plan keeps it."""

from __future__ import annotations

from dataclasses import replace

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.distributed.elastic import adopt, for_world


def test_a_smaller_world_takes_the_accumulation_up_and_the_full_world_brings_it_back() -> None:
    full = Plan(BatchPlan(4, 32, 4), expandable_segments=True, fallbacks_applied=1)
    half = for_world(full, 2)
    assert isinstance(half, Plan)
    assert (half.batch.micro_batch, half.batch.grad_accum, half.batch.world_size) == (4, 4, 2)
    assert half.batch.global_batch == 32 and (half.expandable_segments, half.fallbacks_applied) == (True, 1)
    assert for_world(half, 4) == full  # the node back: the original plan
    assert for_world(full, 4) is full


def test_a_micro_batch_that_does_not_divide_the_new_per_rank_batch_is_split_below_never_above() -> None:
    # 48 over 3 ranks: 16 each at micro 16; over 2: 24 each, which 16 does not divide: 12 × 2; over 4: 12 × 1
    plan = Plan(BatchPlan(16, 48, 3))
    two = for_world(plan, 2)
    assert isinstance(two, Plan) and (two.batch.micro_batch, two.batch.grad_accum) == (12, 2)
    four = for_world(plan, 4)
    assert isinstance(four, Plan) and (four.batch.micro_batch, four.batch.grad_accum) == (12, 1)
    assert all(p.batch.micro_batch * p.batch.grad_accum * p.batch.world_size == 48 for p in (two, four))


def test_where_no_exact_plan_exists_it_says_why_in_one_line() -> None:
    assert for_world(Plan(BatchPlan(4, 16, 2)), 3) == "global batch 16 is not divisible by world 3"
    cannot = Plan(BatchPlan(4, 8, 2, asked_global=8))  # the script takes no accumulation
    assert for_world(cannot, 1) == "the command passes no {grad_accum}, so the global batch 8 cannot be kept at world 1"


def test_every_node_adopts_the_hosts_plan_for_another_world_but_never_another_jobs() -> None:
    mine = Plan(BatchPlan(4, 32, 4), eval_micro_batch=2)
    shared = for_world(mine, 2)
    assert isinstance(shared, Plan)
    assert adopt(mine, shared.as_dict()) == shared
    assert adopt(mine, replace(mine, batch=BatchPlan(2, 32, 4)).as_dict()) == replace(mine, batch=BatchPlan(2, 32, 4))
    assert adopt(mine, Plan(BatchPlan(4, 64, 2)).as_dict()) is None  # another global batch: not this run's
