"""Carrying a multi-node round out: what this node adopts from the shared store, as the loop's types.

``dist.coordination`` moves plain JSON between the nodes; this module turns the loop's plan,
checkpoint, verdict and decision into it and back, so every node runs the same plan from the same
checkpoint and acts on the same decision.
"""

from __future__ import annotations

import os
from typing import Any

from oomguard.supervisor.decide.classify import FailureKind, Verdict
from oomguard.supervisor.decide.policy import Action, Decision, Plan
from oomguard.supervisor.distributed.coordination import Coordinator, choose
from oomguard.supervisor.observe.checkpoints import Checkpoint


def agree_start(coord: Coordinator, round_: int, plan: Plan,
                checkpoint: Checkpoint | None) -> tuple[Plan, Checkpoint | None, dict[str, Any]]:
    """This round's plan and checkpoint: node 0's, on every node."""
    mine = {"plan": plan.as_dict(), "checkpoint": checkpoint.path if checkpoint else None,
            "step": checkpoint.step if checkpoint else None,
            "step_from": checkpoint.step_from if checkpoint else None}
    agreed = coord.start_round(round_, mine)
    adopted = plan.resumed(agreed["plan"]) or plan
    if agreed["checkpoint"] is None:
        return adopted, None, agreed
    path = str(agreed["checkpoint"])
    try:
        stat = os.stat(path)
        mtime, size = stat.st_mtime, stat.st_size
    except OSError:  # not visible here (no shared filesystem): the ranks get node 0's path all the same
        mtime, size = 0.0, 0
    # The step's evidence travels with it (a node 0 of an older oomguard posts none: unknown then).
    return adopted, Checkpoint(path, agreed["step"], mtime, size, step_from=agreed.get("step_from")), agreed


def agree_end(coord: Coordinator, round_: int, verdict: Verdict,
              stopped_for_peer: int | None) -> tuple[Verdict, dict[int, dict[str, Any]]]:
    """Post how this node's attempt ended, read every node's, and return the round's verdict."""
    coord.report_end(round_, {"kind": verdict.kind.value if verdict.kind else None, "evidence": verdict.evidence,
                              "signal": verdict.signal, "exit_code": verdict.exit_code,
                              "stopped_for_peer": stopped_for_peer})
    reports = coord.ends(round_)
    chosen = choose(reports)
    if chosen is None:
        return Verdict(None, "exit code 0 on every node", None, 0), reports
    node, report = chosen
    return Verdict(FailureKind(report["kind"]), f"node {node}: {report['evidence']}", report["signal"],
                   report["exit_code"]), reports


def agree_decision(coord: Coordinator, round_: int, decision: Decision) -> Decision:
    """Node 0's decision after the round, on every node."""
    mine = {"action": decision.action.value, "plan": decision.plan.as_dict(), "reason": decision.reason,
            "delay": decision.delay, "bad_checkpoint": decision.bad_checkpoint}
    agreed = coord.decision(round_, mine)
    plan = decision.plan.resumed(agreed["plan"]) or decision.plan
    return Decision(Action(agreed["action"]), plan, agreed["reason"], float(agreed["delay"]), agreed["bad_checkpoint"])
