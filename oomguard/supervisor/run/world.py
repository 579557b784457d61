"""The attempt's world beyond one process: torchrun's ranks on this node, the other nodes' supervisors.

Tested in tests/unit/supervisor/run/test_world.py, tests/e2e/test_torchrun.py and tests/e2e/test_multinode.py.

For a single-process run this object does nothing. Under torchrun it wraps each attempt's command
in torchrun and reads the root-cause rank after it; with several nodes each round's agreement goes
through the shared store (``agree_*``): every member starts from the host's plan (sized for the
round's world) and checkpoint, ends with the same verdict and acts on the host's decision. In an
elastic run (``--nnodes MIN:MAX``) a member lost or back ends the round as a planned restart.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from oomguard.supervisor.decide.classify import ExitFacts, FailureKind, Verdict, classify
from oomguard.supervisor.decide.policy import Action, Decision, Plan
from oomguard.supervisor.distributed.coordination import Coordinator, PeerLost, adopt, choose, for_world, store_address
from oomguard.supervisor.distributed.launcher import ERROR_FILE_ENV, TorchrunAttempt
from oomguard.supervisor.distributed.torchrun import Shape
from oomguard.supervisor.lifecycle import Stop, StopReason
from oomguard.supervisor.observe.checkpoints import Checkpoint, CheckpointIndex
from oomguard.supervisor.observe.output import OutputScanner
from oomguard.supervisor.record.logs import say as log
from oomguard.supervisor.run.process import AttemptFiles

Event = Callable[..., None]  # the loop's journal-and-listeners event: event(name, **data)


class World:
    def __init__(self, shape: Shape | None, peer_timeout: float, event: Event,
                 checkpoints: CheckpointIndex | None = None, stopping: Callable[[], bool] = lambda: False) -> None:
        self.shape = shape  # ranks and nodes under torchrun; None for one process
        self.nodes = Coordinator(shape, peer_timeout, say=self._say,
                                 stopping=stopping) if shape is not None and shape.nnodes > 1 else None
        self.ranks: TorchrunAttempt | None = None  # this attempt's torchrun, when there is one
        self.peer_stop: int | None = None  # the node whose failure made us stop this attempt
        self.regroup: str | None = None  # why this round ended for the nodes to regroup (elastic runs)
        self._regroup_stop: Stop | None = None  # the stop ``news`` asked for when the nodes regroup
        self._index = checkpoints  # the host takes a node back in after the next checkpoint
        self._back: tuple[list[int], object] | None = None  # nodes back, and the newest checkpoint then
        self._event = event

    def _say(self, line: str) -> None:
        log(line)
        self._event("store_taken_over", line=line)

    def connect(self) -> str | None:
        """Join the shared store (several nodes); the line to log, or None for one node."""
        if self.nodes is None:
            return None
        self.nodes.connect()
        return joined_line(self.nodes)

    def finish(self) -> None:
        if self.nodes is not None:
            self.nodes.finish()

    def start_round(self, plan: Plan, checkpoint: Checkpoint | None) -> tuple[Plan, Checkpoint | None, bool]:
        """Every member: the host's plan and checkpoint for this attempt; True when they were agreed."""
        self.peer_stop, self.regroup, self._back, self._regroup_stop = None, None, None, None
        if self.nodes is None:
            return plan, checkpoint, False
        before = plan.batch
        plan, checkpoint, agreed = agree_start(self.nodes, plan, checkpoint)
        self._event("round_start", node=self.nodes.node, **agreed)  # agreed: round, host, members, plan...
        if plan.batch.world_size != before.world_size:
            nodes = len(self.nodes.members)
            self._event("world_change", round=self.nodes.round, nodes=nodes, members=list(self.nodes.members),
                        world_size=plan.batch.world_size, from_world_size=before.world_size,
                        micro_batch=plan.batch.micro_batch, grad_accum=plan.batch.grad_accum,
                        global_batch=plan.batch.global_batch)
            log(f"round {self.nodes.round}: {nodes} of {self.nodes.shape.nnodes} nodes (nodes "
                f"{', '.join(map(str, self.nodes.members))}): {plan.batch.describe()}, the global batch asked")
        return plan, checkpoint, True

    def command(self, argv: list[str], env: dict[str, str], files: AttemptFiles, attempt: int) -> list[str]:
        """With ranks: the attempt's torchrun argv (and the environment torchrun passes on)."""
        nodes = self.nodes
        rdzv = f"attempt-{nodes.round if nodes is not None else attempt}"  # the same on every node of the round
        self.ranks = TorchrunAttempt.of(self.shape, argv, files.log.with_suffix(".ranks"), rdzv,
                                        len(nodes.members) if nodes is not None and nodes.shape.elastic else None)
        if self.ranks is None:
            return argv
        env[ERROR_FILE_ENV] = str(self.ranks.agent_error_file)
        env["OOMGUARD_NODE_RANK"] = str(nodes.node if nodes is not None else 0)
        return self.ranks.argv

    def line_sink(self, feed: Callable[[str], None]) -> Callable[[str], None]:
        """Each output line goes to ``feed`` (evidence and progress), and to the ranks' scanner."""
        ranks = self.ranks
        if ranks is None:
            return feed

        def both(line: str) -> None:
            feed(line)
            ranks.scanner.feed(line)

        return both

    def verdict(self, facts: ExitFacts, scanner: OutputScanner, gpus: bool) -> Verdict:
        """How the attempt ended: by its root-cause rank under torchrun, and the same on every node."""
        cause = self.ranks.root_cause() if self.ranks is not None and facts.returncode else None
        if cause is not None:
            self._event("root_cause", **cause.as_dict())
        verdict = classify(facts, scanner, cause, gpus)
        if self.nodes is not None:
            verdict, reports, lost = agree_end(self.nodes, verdict, self.peer_stop)
            self._event("round_end", round=self.nodes.round, reports={str(k): v for k, v in reports.items()},
                        kind=verdict.kind.value if verdict.kind else None, evidence=verdict.evidence,
                        lost=list(lost))
            why = self.nodes.regrouped()
            if why is not None and verdict.kind is not None:  # ranks that all finished finished the run
                self.regroup = why
        return verdict

    def stop(self, stop: Stop | None) -> Stop | None:
        """The stop this attempt ends with, the same on every node: a round ended for the nodes to regroup
        is a planned restart, unless every member's ranks finished; the user's stop stays."""
        if stop is not None and stop.reason is StopReason.USER:
            return stop
        if self.regroup is not None:
            return Stop(StopReason.PLANNED, self.regroup)
        return None if stop is not None and stop == self._regroup_stop else stop

    def news(self) -> Stop | None:
        """Why this node's ranks must stop now, once: a member failed, was lost, or is back after a checkpoint."""
        if self.nodes is None or self.peer_stop is not None or self._regroup_stop is not None:
            return None
        self._take_back()
        news = self.nodes.news()
        if news is None:
            return None
        if news.regroup:
            self._regroup_stop = Stop(StopReason.PLANNED, news.why)
            return self._regroup_stop
        self.peer_stop = news.node
        return Stop(StopReason.PEER, news.why)

    def _take_back(self) -> None:
        """The host of an elastic run short of nodes takes a node heard again in after the next checkpoint."""
        nodes = self.nodes
        if nodes is None or not nodes.leader or self._index is None:
            return
        if self._back is None:
            back = nodes.newcomers()
            if back:
                self._back = (back, _version(self._index.newest(set(), worker_alive=True)))
                log(f"node {', '.join(map(str, back))} is back: taken in after the next checkpoint")
            return
        newest = self._index.newest(set(), worker_alive=True)
        if newest is not None and _version(newest) != self._back[1]:
            nodes.regroup(f"node {', '.join(map(str, self._back[0]))} back: taken in after {newest.path}")

    def decision(self, decision: Decision) -> Decision:
        """The host decides for every node."""
        if self.nodes is None:
            return decision
        agreed = self.nodes.decision({"action": decision.action.value, "plan": decision.plan.as_dict(),
                                      "reason": decision.reason, "delay": decision.delay,
                                      "bad_checkpoint": decision.bad_checkpoint})
        plan = adopt(decision.plan, agreed["plan"]) or decision.plan
        return Decision(Action(agreed["action"]), plan, agreed["reason"], float(agreed["delay"]),
                        agreed["bad_checkpoint"])


def _version(checkpoint: Checkpoint | None) -> object:
    """A checkpoint as written: a script that saves over one path writes a new one all the same."""
    return None if checkpoint is None else (checkpoint.path, checkpoint.signature)


def joined_line(nodes: Coordinator) -> str:
    """Which node this is in the shared rounds, and how it came to be it."""
    host, port = store_address(nodes.shape)
    shape = nodes.shape
    how = "" if shape.node_rank is not None else (
        " (the rendezvous host is this machine and this node bound first)" if nodes.leader
        else " (joined in that order; c10d numbers torchrun's ranks itself)")
    keeper = "oomguard's store" if shape.elastic else "node 0's store"  # an elastic run's host may have changed
    where = f"hosts oomguard's store on port {port}" if nodes.leader else f"shares {keeper} at {host}:{port}"
    count = f"{shape.min_nodes}:{shape.nnodes}" if shape.elastic else str(shape.nnodes)
    return f"node {nodes.node} of {count}: {where}{how}"


# --- a round carried through the shared store, as the loop's types ---------------------------------


def agree_start(coord: Coordinator, plan: Plan,
                checkpoint: Checkpoint | None) -> tuple[Plan, Checkpoint | None, dict[str, Any]]:
    """The host's members, plan and checkpoint on every node (exit 75 where no plan keeps the batch)."""
    mine = {"plan": plan.as_dict(), "checkpoint": checkpoint.path if checkpoint else None,
            "step": checkpoint.step if checkpoint else None,
            "step_from": checkpoint.step_from if checkpoint else None}
    if coord.leader:
        mine = {**mine, **_sized(coord, plan)}
    agreed = coord.start_round(mine)
    adopted = adopt(plan, agreed["plan"]) or plan
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
    """The host's members and its plan for their world; else the line that ends the run, on every node."""
    members = coord.gather()
    nodes = len(members)
    world = nodes * coord.shape.nproc_per_node
    sized = for_world(plan, world)
    if isinstance(sized, str):
        line = (f"{nodes} of {coord.shape.nnodes} nodes left (world {world}): {sized}, so no plan keeps the global "
                "batch exact; ending for the scheduler to requeue the full set")
        coord.start_round({"members": members, "stop": line, "plan": plan.as_dict(), "checkpoint": None})
        raise PeerLost(line)
    return {"members": list(members), "plan": sized.as_dict()}


def agree_end(coord: Coordinator, verdict: Verdict,
              stopped_for_peer: int | None) -> tuple[Verdict, dict[int, dict[str, Any]], tuple[int, ...]]:
    """Post this node's ending, read every member's: the round's verdict, the posts, the members lost."""
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
