"""An attempt ends as one value (issue 21): the pure ``ending_of``, the plan changes of ``decide.policy``,
the journal's ``ending``/``stop_reason`` columns, and real runs whose worker oomguard stops for a reason."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide import policy
from oomguard.supervisor.decide.classify import FailureKind, Verdict
from oomguard.supervisor.decide.policy import Action, Decision, Plan
from oomguard.supervisor.lifecycle import GRACE_CAP, Ending, Pending, Stop, StopReason, ending_of, grace
from oomguard.supervisor.record.journal import Journal

FINISHED = Verdict(None, "exit code 0", None, 0)
KILLED = Verdict(FailureKind.KILLED, "terminated by SIGTERM", 15, None)
HUNG = Verdict(FailureKind.HANG, "no progress for 30 s", 15, None)


@pytest.mark.parametrize("stop,verdict,user,expected", [
    (None, FINISHED, False, Ending.FINISHED),
    (None, KILLED, False, Ending.FAILED),
    (Stop(StopReason.HANG, "quiet"), HUNG, False, Ending.HANG),
    (Stop(StopReason.MEMORY, "rss"), Verdict(FailureKind.MEMORY_LIMIT, "rss", 15, None), False, Ending.FAILED),
    (Stop(StopReason.PEER, "node 1"), KILLED, False, Ending.PEER_STOPPED),
    # a restart oomguard asked for is no failure, whatever the worker exited with
    (Stop(StopReason.PLANNED, "forecast"), KILLED, False, Ending.PLANNED_RESTART),
    (Stop(StopReason.PLANNED, "forecast"), FINISHED, False, Ending.PLANNED_RESTART),
    (Stop(StopReason.RESTART, "asked"), KILLED, False, Ending.PLANNED_RESTART),
    (Stop(StopReason.GROW, "grow", 32), FINISHED, False, Ending.GROW),
    # the user's stop wins over everything, also over a restart already under way
    (Stop(StopReason.USER, "SIGINT"), KILLED, True, Ending.STOPPED),
    (Stop(StopReason.PLANNED, "forecast"), KILLED, True, Ending.STOPPED),
    (None, FINISHED, True, Ending.STOPPED),
])
def test_ending_of(stop: Stop | None, verdict: Verdict, user: bool, expected: Ending) -> None:
    assert ending_of(stop, verdict, user) is expected


def test_each_stop_reason_has_its_grace() -> None:
    assert set(GRACE_CAP) == set(StopReason)
    assert grace(StopReason.USER, 900) == 900 and grace(StopReason.PLANNED, 900) == 900
    assert grace(StopReason.MEMORY, 900) == 5 and grace(StopReason.HANG, 900) == 10
    assert grace(StopReason.HANG, 3) == 3  # never longer than --grace-period


PLAN = Plan(BatchPlan(16, 64, 1))


def test_every_plan_change_carries_its_source_and_reason() -> None:
    assert policy.start_at_fitted(PLAN, None, "job") is None and policy.start_at_fitted(PLAN, 16, "job") is None
    fitted = policy.start_at_fitted(PLAN, 8, "job x")
    assert fitted is not None and fitted.plan.batch.grad_accum == 8 and fitted.source is policy.Source.FIT_STORE
    grown = policy.grow(PLAN, 32)
    assert (grown.plan.batch.micro_batch, grown.plan.batch.grad_accum, grown.plan.batch.global_batch) == (32, 2, 64)
    assert grown.reason == "grow: micro-batch 16 -> 32 × accumulation 2"
    assert policy.planned_restart(PLAN, "forecast").plan == PLAN
    assert policy.allocator_from_environment(PLAN, False) is None
    alloc = policy.allocator_from_environment(PLAN, True)
    assert alloc is not None and alloc.plan.expandable_segments
    assert policy.allocator_from_environment(alloc.plan, True) is None  # already set: no change
    assert policy.agreed(PLAN, PLAN) is None
    node0 = policy.agreed(PLAN, Plan(BatchPlan(8, 64, 1)))
    assert node0 is not None and node0.source is policy.Source.AGREED
    decision = Decision(Action.RESTART, Plan(BatchPlan(8, 64, 1)), "cuda_oom at micro-batch 16")
    assert policy.after_failure(decision).reason == "cuda_oom at micro-batch 16"
    saved = policy.continue_saved(PLAN, {**Plan(BatchPlan(4, 64, 1)).as_dict()})
    assert saved is not None and saved.plan.batch.micro_batch == 4
    assert policy.continue_saved(PLAN, {**Plan(BatchPlan(4, 16, 1)).as_dict()}) is None  # another global batch


def test_a_journal_from_before_the_ending_column_gains_it(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "journal.sqlite")
    db.executescript("""CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE attempts (
        attempt INTEGER PRIMARY KEY, started REAL NOT NULL, ended REAL, pid INTEGER,
        micro_batch INTEGER NOT NULL, grad_accum INTEGER NOT NULL, global_batch INTEGER NOT NULL,
        world_size INTEGER NOT NULL, checkpoint TEXT, command TEXT NOT NULL, log_path TEXT NOT NULL,
        expandable_segments INTEGER NOT NULL DEFAULT 0, fallbacks_applied INTEGER NOT NULL DEFAULT 0,
        returncode INTEGER, exit_code INTEGER, signal INTEGER, kind TEXT, evidence TEXT, decision TEXT,
        last_step INTEGER, peak_rss INTEGER, peak_gpu INTEGER);""")
    db.execute("INSERT INTO attempts (attempt, started, ended, micro_batch, grad_accum, global_batch, world_size, "
               "command, log_path, kind, decision) VALUES (1, 1, 2, 8, 1, 8, 1, '[]', 'x', 'crash', 'restart')")
    db.commit()
    db.close()
    journal = Journal(tmp_path)
    try:
        (row,) = journal.attempts()
        assert row["ending"] is None and row["kind"] == "crash"  # an old row: read by what it did write
        journal.end_attempt(1, ending="failed", stop_reason=None)
        assert journal.attempts()[0]["ending"] == "failed"
    finally:
        journal.close()


# ``Pending``: the one value for "restart at the next checkpoint", whatever its reason.


def test_the_forecasts_restart_acts_on_the_workers_word_and_keeps_its_reason() -> None:
    pending = Pending(StopReason.PLANNED, "planned restart after the next checkpoint: limit in 40 s")
    assert pending.on_save_record
    assert pending.stop("ck/step-40") == Stop(StopReason.PLANNED, pending.detail)
    assert ending_of(pending.stop(None), Verdict(None, "", None, 0), False) is Ending.PLANNED_RESTART


def test_a_grow_waits_for_the_file_and_names_it_with_its_size() -> None:
    pending = Pending(StopReason.GROW, "--grow: micro-batch 32", 32)
    assert not pending.on_save_record
    stop = pending.stop("ck/step-40")
    assert stop == Stop(StopReason.GROW, "--grow: micro-batch 32 after ck/step-40", 32)
    assert ending_of(stop, Verdict(None, "", None, 143), False) is Ending.GROW
