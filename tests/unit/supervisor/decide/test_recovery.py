"""decide/recovery.py: what follows a failed attempt, from scripted facts and histories, with no I/O.

The function is fed what the attempt left (its verdict, its watch, its readings) and returns the
decision with the events to record, in order; the memory knowledge it is given is never changed
(what it learned comes back as a value) and its fit store is never touched.
"""

from __future__ import annotations

from typing import Any

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.attribution import Cause, Evidence
from oomguard.supervisor.decide.classify import Addition, FailureKind, Verdict
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig
from oomguard.supervisor.decide.recovery import Facts, Readings, RecoveryConfig, decision_event, recover
from oomguard.supervisor.observe.progress import AttemptWatch
from oomguard.supervisor.sizing.memmodel import SizeTuner
from oomguard.supervisor.sizing.trend import Reading

MB = 1024 * 1024


class NoStore:
    """A fit store any call to which fails the test: the recovery must do no I/O."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the recovery touched the fit store ({name})")


def plan(micro: int = 32, global_batch: int = 128) -> Plan:
    return Plan(BatchPlan(micro, global_batch, 1))


def tuner() -> SizeTuner:
    return SizeTuner(128, 1, margin=0.1, store=NoStore())  # type: ignore[arg-type]


def facts(kind: FailureKind | None, attempt: int = 1, evidence: str = "x", series: list[Reading] | None = None,
          **more: Any) -> Facts:
    memory = kind is not None and kind.is_memory
    return Facts(attempt, Verdict(kind, evidence, None, 1), AttemptWatch(),
                 evidence=Evidence() if memory else None,
                 readings=Readings("worker RSS", tuple(series or ())) if memory else None, **more)


def test_an_oom_halves_with_its_cause_journaled_and_its_point_learned_not_stored() -> None:
    memory = tuner()
    found = recover(facts(FailureKind.CUDA_OOM), [], plan(32), memory, RecoveryConfig())
    assert found.decision.action is Action.RESTART and found.decision.plan.batch.micro_batch == 16
    assert found.decision.plan.expandable_segments  # set with the shrink after a CUDA OOM
    assert [n.name for n in found.notes] == ["attribution"]
    assert found.notes[0].say is not None and found.notes[0].say.startswith("cause: ")
    assert found.attribution is not None and found.attribution.cause is Cause.PER_SAMPLE
    assert found.point is not None and found.point.micro_batch == 32 and not found.point.succeeded
    assert memory.points == [] and found.memory.points == [found.point]  # the knowledge given is unchanged
    assert found.failure.kind is FailureKind.CUDA_OOM and found.failure.micro_batch == 32
    event = decision_event(found.decision, found.failure)
    assert event["action"] == "restart" and event["micro_batch"] == 16 and event["cause"] == "per_sample"


def test_a_leak_restarts_at_the_same_size_keeps_its_rate_and_stays_out_of_the_model() -> None:
    creep = [Reading(float(i), 400 * MB + i * 4 * MB) for i in range(60)]
    found = recover(facts(FailureKind.HOST_OOM, series=creep), [], plan(32), tuner(), RecoveryConfig())
    assert found.attribution is not None and found.attribution.cause is Cause.LEAK
    assert found.decision.restart and found.decision.plan.batch.micro_batch == 32
    assert found.leak_per_s is not None and 3.5 * MB < found.leak_per_s < 4.5 * MB
    assert found.point is None and found.memory.points == []  # a leak's peak is no point on the line


def test_a_second_leak_without_progress_gives_up() -> None:
    creep = [Reading(float(i), 400 * MB + i * 4 * MB) for i in range(60)]
    first = recover(facts(FailureKind.HOST_OOM, series=creep), [], plan(32), tuner(), RecoveryConfig())
    again = recover(facts(FailureKind.HOST_OOM, attempt=2, series=creep), [first.failure], plan(32), tuner(),
                    RecoveryConfig())
    assert again.decision.action is Action.GIVE_UP and "no progress between restarts" in again.decision.reason


def test_our_own_spare_failing_turns_it_off_and_blames_nothing_of_the_script() -> None:
    own = facts(FailureKind.HOST_OOM, additions=frozenset({Addition.SPARE}), handover_lost="it had exited")
    found = recover(own, [], plan(32), tuner(), RecoveryConfig())
    assert found.failure.own is not None and found.decision.turn_off is Addition.SPARE
    assert found.decision.plan == plan(32)  # the same plan: the script's batch is not to blame
    assert found.attribution is None and found.point is None and found.notes == ()


def test_the_same_crash_three_times_without_a_checkpoint_is_a_crash_loop() -> None:
    history = [Failure(n, FailureKind.CRASH, 32, "boom") for n in (1, 2)]
    found = recover(facts(FailureKind.CRASH, attempt=3, evidence="boom"), history, plan(32), tuner(),
                    RecoveryConfig(PolicyConfig(max_restarts=10)))
    assert found.decision.action is Action.GIVE_UP and found.decision.reason.startswith("crash loop")
    assert found.notes == () and found.point is not None and found.point.succeeded  # a crash: the size fit


def test_a_crash_backs_off_doubling_from_the_history() -> None:
    history = [Failure(1, FailureKind.CRASH, 32, "a")]
    found = recover(facts(FailureKind.CRASH, attempt=2, evidence="b"), history, plan(32), tuner(),
                    RecoveryConfig(PolicyConfig(backoff=1.0, max_backoff=60.0)))
    assert found.decision.restart and found.decision.delay == 2.0


def test_the_same_facts_give_the_same_recovery() -> None:
    memory, config = tuner(), RecoveryConfig()
    one = recover(facts(FailureKind.CUDA_OOM), [], plan(32), memory, config)
    two = recover(facts(FailureKind.CUDA_OOM), [], plan(32), memory, config)
    assert one.decision == two.decision and one.notes == two.notes and one.point == two.point
