"""The batch plan for another world size: what an elastic run (torchrun's ``--nnodes MIN:MAX``) trains
at when a node is lost or comes back. Pure: no I/O, no clock.

The global batch stays the one asked: the per-rank batch becomes global ÷ new world, so the
accumulation becomes accumulation × old world ÷ new world at the same micro-batch; where the
micro-batch does not divide the new per-rank batch it is re-split to the largest divisor below it
(never above it: a larger micro-batch was never shown to fit). Where the new world does not divide
the global batch no exact plan exists, and that is said, never rounded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from oomguard.common.batch import BatchPlan, largest_divisor_at_most
from oomguard.supervisor.decide.policy import Plan


def for_world(plan: Plan, world: int) -> Plan | str:
    """``plan`` at ``world`` ranks with the same global batch; the one line saying why not, where no
    exact plan exists."""
    b = plan.batch
    if world == b.world_size:
        return plan
    if not b.accumulates:
        return (f"the command passes no {{grad_accum}}, so the global batch {b.asked} cannot be kept at "
                f"world {world}")
    if b.global_batch % world:
        return f"global batch {b.global_batch} is not divisible by world {world}"
    micro = largest_divisor_at_most(b.global_batch // world, b.micro_batch)
    assert micro is not None  # 1 divides every per-rank batch
    return replace(plan, batch=BatchPlan(micro, b.global_batch, world))


def adopt(plan: Plan, agreed: Mapping[str, Any]) -> Plan | None:
    """The round's shared plan (``Plan.as_dict``) as this node's, whatever world it is for; None when
    it is not for the global batch this node was asked (another job on the same store)."""
    resumed = plan.resumed(agreed)
    if resumed is not None or agreed.get("world_size") == plan.batch.world_size:
        return resumed
    if (agreed.get("asked_global") or agreed.get("global_batch")) != plan.batch.asked:
        return None
    try:
        batch = BatchPlan(int(agreed["micro_batch"]), int(agreed["global_batch"]), int(agreed["world_size"]),
                          agreed.get("asked_global"))
    except (KeyError, TypeError, ValueError):
        return None
    return Plan(batch, bool(agreed.get("expandable_segments")), int(agreed.get("fallbacks_applied") or 0),
                agreed.get("eval_micro_batch", plan.eval_micro_batch), agreed.get("num_workers", plan.num_workers))
