"""The attempt's world beyond one process: torchrun's ranks on this node, the other nodes' supervisors.

Tested in tests/e2e/test_torchrun.py and tests/e2e/test_multinode.py.

For a single-process run this object does nothing and the loop never notices it. Under torchrun it
wraps each attempt's command in torchrun (ranks' error files under the run directory), reads the
root-cause rank after the attempt, and, with several nodes, carries each round's agreement through
node 0's store (``run.rounds``): every node starts from node 0's plan and checkpoint, ends with the
same verdict and acts on node 0's decision. The loop calls it at those points and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable

from oomguard.supervisor.decide.classify import ExitFacts, Verdict, classify
from oomguard.supervisor.decide.policy import Decision, Plan
from oomguard.supervisor.distributed.attempt import ERROR_FILE_ENV, TorchrunAttempt
from oomguard.supervisor.distributed.coordination import Coordinator, store_address
from oomguard.supervisor.distributed.torchrun import Shape
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.observe.output import OutputScanner
from oomguard.supervisor.run.rounds import agree_decision, agree_end, agree_start
from oomguard.supervisor.run.runtime import AttemptFiles

Event = Callable[..., None]  # the loop's journal-and-listeners event: event(name, **data)


class World:
    def __init__(self, shape: Shape | None, peer_timeout: float, event: Event) -> None:
        self.shape = shape  # ranks and nodes under torchrun; None for one process
        multi = shape is not None and shape.nnodes > 1
        self.nodes = Coordinator(shape, peer_timeout) if shape is not None and multi else None
        self.ranks: TorchrunAttempt | None = None  # this attempt's torchrun, when there is one
        self.peer_stop: int | None = None  # the node whose failure made us stop this attempt
        self._event = event

    def connect(self) -> str | None:
        """Join node 0's store (several nodes); the line to log, or None for one node."""
        if self.nodes is None:
            return None
        self.nodes.connect()
        return joined_line(self.nodes)

    def finish(self) -> None:
        if self.nodes is not None:
            self.nodes.finish()

    def start_round(self, attempt: int, plan: Plan,
                    checkpoint: Checkpoint | None) -> tuple[Plan, Checkpoint | None, bool]:
        """Every node: node 0's plan and checkpoint for this attempt; True when they were agreed."""
        self.peer_stop = None
        if self.nodes is None:
            return plan, checkpoint, False
        plan, checkpoint, agreed = agree_start(self.nodes, attempt, plan, checkpoint)
        self._event("round_start", round=attempt, node=self.nodes.node, **agreed)
        return plan, checkpoint, True

    def command(self, argv: list[str], env: dict[str, str], files: AttemptFiles, attempt: int) -> list[str]:
        """With ranks: the attempt's torchrun argv and the environment torchrun passes on; a
        single-process run keeps its argv."""
        self.ranks = TorchrunAttempt.of(self.shape, argv, files.log.with_suffix(".ranks"), f"attempt-{attempt}")
        if self.ranks is None:
            return argv
        env[ERROR_FILE_ENV] = str(self.ranks.agent_error_file)
        env["OOMGUARD_NODE_RANK"] = str(self.nodes.node if self.nodes is not None else 0)
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

    def verdict(self, facts: ExitFacts, scanner: OutputScanner, gpus: bool, attempt: int) -> Verdict:
        """How the attempt ended: by its root-cause rank under torchrun, and the same on every node."""
        cause = self.ranks.root_cause() if self.ranks is not None and facts.returncode else None
        if cause is not None:
            self._event("root_cause", **cause.as_dict())
        verdict = classify(facts, scanner, cause, gpus)
        if self.nodes is not None:
            verdict, reports = agree_end(self.nodes, attempt, verdict, self.peer_stop)
            self._event("round_end", round=attempt, reports={str(k): v for k, v in reports.items()},
                        kind=verdict.kind.value if verdict.kind else None, evidence=verdict.evidence)
        return verdict

    def peer_failed(self, attempt: int) -> int | None:
        """Another node's attempt failed (first time seen): ours would only wait in a collective."""
        if self.nodes is None or self.peer_stop is not None:
            return None
        self.peer_stop = self.nodes.peer_failed(attempt)
        return self.peer_stop

    def decision(self, attempt: int, decision: Decision) -> Decision:
        """Node 0 decides for every node."""
        return decision if self.nodes is None else agree_decision(self.nodes, attempt, decision)



def joined_line(nodes: Coordinator) -> str:
    """Which node this is in the shared rounds, and how it came to be it."""
    host, port = store_address(nodes.shape)
    how = "" if nodes.shape.node_rank is not None else (
        " (the rendezvous host is this machine and this node bound first)" if nodes.leader
        else " (joined in that order; c10d numbers torchrun's ranks itself)")
    where = f"hosts oomguard's store on port {port}" if nodes.leader else f"shares node 0's store at {host}:{port}"
    return f"node {nodes.node} of {nodes.shape.nnodes}: {where}{how}"
