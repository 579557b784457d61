"""A multi-node round's start: every node adopts node 0's checkpoint with the evidence of its step."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.distributed.coordination import Coordinator
from oomguard.supervisor.distributed.torchrun import Shape
from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.run.world import agree_start


class Store:
    """The shared store's start key, as ``Coordinator.start_round`` uses it: node 0 publishes its
    proposal, the others read node 0's."""

    def __init__(self) -> None:
        self.published: dict[str, Any] | None = None

    def node(self, leader: bool) -> Coordinator:
        store = self

        class Node:
            shape = Shape(1, 2, None, "h:1")

            @property
            def leader(self) -> bool:
                return leader

            def gather(self) -> tuple[int, ...]:
                return (0, 1)

            def start_round(self, proposal: dict[str, Any]) -> dict[str, Any]:
                if leader:
                    store.published = proposal
                assert store.published is not None
                return store.published

        return cast(Coordinator, Node())


def test_every_node_resumes_from_node_0s_checkpoint_with_its_steps_evidence(tmp_path: Path) -> None:
    """The resume point journaled on each node says which evidence gave its step: the rank-less
    torchrun e2e run journaled step 2 with ``step_from`` null on both nodes, node 0 included, though
    node 0's index had read it from the name (a step without its evidence is never journaled)."""
    ck = tmp_path / "step-2"
    ck.mkdir()
    plan = Plan(BatchPlan(4, 32, 2))
    store = Store()
    mine = Checkpoint(str(ck), 2, ck.stat().st_mtime, 0, step_from=ckptstep.SAVE)
    _, led, _ = agree_start(store.node(leader=True), plan, mine)
    _, followed, _ = agree_start(store.node(leader=False), plan, None)
    for adopted in (led, followed):
        assert adopted is not None
        assert (adopted.path, adopted.step, adopted.step_from) == (str(ck), 2, ckptstep.SAVE)
    # A node 0 of an older oomguard posts no step_from: the step stands, its evidence unknown.
    del store.published["step_from"]  # type: ignore[index]
    _, older, _ = agree_start(store.node(leader=False), plan, None)
    assert older is not None and (older.step, older.step_from) == (2, None)
