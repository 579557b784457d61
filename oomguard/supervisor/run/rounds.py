"""Carrying a multi-node round out: what this node adopts from the shared store, as the loop's types.

``dist.coordination`` moves plain JSON between the nodes; this module turns the loop's plan,
checkpoint, verdict and decision into it and back, so every node runs the same plan from the same
checkpoint and acts on the same decision. The host sizes the plan for the round's world
(``dist.elastic``): an elastic run that lost a node trains at the same global batch on the nodes left.
"""

from __future__ import annotations

import os
from typing import Any

from oomguard.supervisor.decide.classify import FailureKind, Verdict
from oomguard.supervisor.decide.policy import Action, Decision, Plan
from oomguard.supervisor.distributed import coordination as elastic
from oomguard.supervisor.distributed.coordination import Coordinator, PeerLost, choose
from oomguard.supervisor.observe.checkpoints import Checkpoint


def agree_start(coord: Coordinator, plan: Plan,
                checkpoint: Checkpoint | None) -> tuple[Plan, Checkpoint | None, dict[str, Any]]:
    """This round's members, plan and checkpoint: the host's, on every node. Where the members' world
    has no plan at the global batch asked, the host says so on every node and the run ends (exit 75)."""
    mine = {"plan": plan.as_dict(), "checkpoint": checkpoint.path if checkpoint else None,
            "step": checkpoint.step if checkpoint else None,
            "step_from": checkpoint.step_from if checkpoint else None}
    if coord.leader:
        mine = {**mine, **_sized(coord, plan)}
    agreed = coord.start_round(mine)
    adopted = elastic.adopt(plan, agreed["plan"]) or plan
    if agreed["checkpoint"] is None:
        return adopted, None, agreed
    path = str(agreed["checkpoint"])
    try:
        stat = os.stat(path)
        mtime, size = stat.st_mtime, stat.st_size
    except OSError:  # not visible here (no shared filesystem): the ranks get the host's path all the same
        mtime, size = 0.0, 0
    # The step's evidence travels with it (a host of an older oomguard posts none: unknown then).
    return adopted, Checkpoint(path, agreed["step"], mtime, size, step_from=agreed.get("step_from")), agreed


def _sized(coord: Coordinator, plan: Plan) -> dict[str, Any]:
    """The host's members and its plan for their world; where none is exact, the line that ends the
    run is published to every node first."""
    members = coord.gather()
    nodes = len(members)
    world = nodes * coord.shape.nproc_per_node
    sized = elastic.for_world(plan, world)
    if isinstance(sized, str):
        line = (f"{nodes} of {coord.shape.nnodes} nodes left (world {world}): {sized}, so no plan keeps the global "
                "batch exact; ending for the scheduler to requeue the full set")
        coord.start_round({"members": members, "stop": line, "plan": plan.as_dict(), "checkpoint": None})
        raise PeerLost(line)
    return {"members": list(members), "plan": sized.as_dict()}


def agree_end(coord: Coordinator, verdict: Verdict,
              stopped_for_peer: int | None) -> tuple[Verdict, dict[int, dict[str, Any]], tuple[int, ...]]:
    """Post how this node's attempt ended, read every member's, and return the round's verdict with
    the posts and the members lost before posting."""
    coord.report_end({"kind": verdict.kind.value if verdict.kind else None, "evidence": verdict.evidence,
                      "signal": verdict.signal, "exit_code": verdict.exit_code,
                      "stopped_for_peer": stopped_for_peer})
    reports, lost = coord.ends()
    chosen = choose(reports)
    if chosen is None:
        everyone = "every node" if not lost else f"every node left ({len(reports)})"
        return Verdict(None, f"exit code 0 on {everyone}", None, 0), reports, lost
    node, report = chosen
    return Verdict(FailureKind(report["kind"]), f"node {node}: {report['evidence']}", report["signal"],
                   report["exit_code"]), reports, lost


def agree_decision(coord: Coordinator, decision: Decision) -> Decision:
    """The host's decision after the round, on every node."""
    mine = {"action": decision.action.value, "plan": decision.plan.as_dict(), "reason": decision.reason,
            "delay": decision.delay, "bad_checkpoint": decision.bad_checkpoint}
    agreed = coord.decision(mine)
    plan = elastic.adopt(decision.plan, agreed["plan"]) or decision.plan
    return Decision(Action(agreed["action"]), plan, agreed["reason"], float(agreed["delay"]), agreed["bad_checkpoint"])
