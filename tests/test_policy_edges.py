"""The policy's edges, each pinned where a one-character change would move it (issue 30): the
crash-loop rule reads the evidence, ``--max-restarts N`` allows exactly N restarts, and a saved plan
is resumed only for the same world size and global batch."""

from __future__ import annotations

import pytest

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.decide.policy import CRASH_LOOP_REPEATS, Action, Failure, Plan, PolicyConfig, decide

CRASH, HANG, OOM = FailureKind.CRASH, FailureKind.HANG, FailureKind.CUDA_OOM


def plan(micro: int = 8, global_batch: int = 96, world: int = 1) -> Plan:
    return Plan(BatchPlan(micro, global_batch, world))


def actions(failures: list[Failure], config: PolicyConfig) -> list[str]:
    """The action after each failure, each decided with the ones before it as history."""
    return [decide(f, failures[:i], plan(), config).action.value for i, f in enumerate(failures)]


def test_the_same_crash_three_times_is_a_crash_loop() -> None:
    same = [Failure(i, CRASH, 8, "ValueError: bad data in shard 7") for i in range(1, CRASH_LOOP_REPEATS + 1)]
    assert actions(same, PolicyConfig(max_restarts=10)) == ["restart"] * (CRASH_LOOP_REPEATS - 1) + ["give_up"]
    last = decide(same[-1], same[:-1], plan(), PolicyConfig(max_restarts=10))
    assert last.reason.startswith("crash loop: crash 3 times in a row") and "shard 7" in last.reason


@pytest.mark.parametrize("evidence", [["a", "b", "c"], ["a", "a", "b"], ["a", "b", "b"]])
def test_crashes_whose_evidence_differs_are_not_a_loop(evidence: list[str]) -> None:
    failures = [Failure(i, CRASH, 8, text) for i, text in enumerate(evidence, 1)]
    assert actions(failures, PolicyConfig(max_restarts=10)) == ["restart"] * 3


def test_the_same_evidence_under_another_kind_is_not_a_loop() -> None:
    failures = [Failure(1, CRASH, 8, "x"), Failure(2, HANG, 8, "x"), Failure(3, CRASH, 8, "x")]
    assert actions(failures, PolicyConfig(max_restarts=10)) == ["restart"] * 3


@pytest.mark.parametrize("limit", [0, 1, 4])
def test_max_restarts_n_allows_exactly_n_restarts(limit: int) -> None:
    """Crashes with evidence that differs every time (no crash loop): the Nth is restarted, the
    N+1th ends the run; memory failures between them use none of the budget."""
    failures: list[Failure] = []
    for i in range(1, limit + 2):
        failures += [Failure(2 * i - 1, OOM, 8), Failure(2 * i, CRASH, 8, f"crash {i}")]
    got = actions(failures, PolicyConfig(max_restarts=limit))
    crashes = got[1::2]
    assert crashes == ["restart"] * limit + ["give_up"]
    assert set(got[::2]) == {"restart"}
    final = decide(failures[-1], failures[:-1], plan(), PolicyConfig(max_restarts=limit))
    assert final.action is Action.GIVE_UP and f"--max-restarts {limit} is used up" in final.reason


def test_a_saved_plan_is_resumed_for_the_same_job() -> None:
    saved = plan(micro=8, global_batch=96, world=2).as_dict()
    resumed = plan(micro=48, global_batch=96, world=2).resumed(saved)
    assert resumed is not None and (resumed.batch.micro_batch, resumed.batch.world_size) == (8, 2)


@pytest.mark.parametrize("world", [1, 4])
def test_a_saved_plan_is_not_resumed_after_the_world_size_changed(world: int) -> None:
    """Micro-batch 8 fit on 2 ranks; on another number of ranks the same global batch needs another
    shape, and what fit per rank before says nothing certain: start from what was asked."""
    saved = plan(micro=8, global_batch=96, world=2).as_dict()
    assert plan(micro=96 // world, global_batch=96, world=world).resumed(saved) is None


def test_a_saved_plan_is_not_resumed_for_another_global_batch() -> None:
    saved = plan(micro=8, global_batch=96).as_dict()
    assert plan(micro=16, global_batch=64).resumed(saved) is None
    assert plan(micro=16, global_batch=96).resumed(None) is None
