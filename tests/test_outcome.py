"""An attempt ends as one value (issue 21): the pure ``ending_of``, the plan changes of ``decide.replan``,
the journal's ``ending``/``stop_reason`` columns, and real runs whose worker oomguard stops for a reason."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import ROOT, WORKER, oomguard

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.cli import build_parser
from oomguard.supervisor.config import build_config
from oomguard.supervisor.decide import replan
from oomguard.supervisor.decide.classify import FailureKind, Verdict
from oomguard.supervisor.decide.policy import Action, Decision, Plan
from oomguard.supervisor.lifecycle.outcome import GRACE_CAP, Stop, ending_of, grace
from oomguard.supervisor.lifecycle.states import Ending, StopReason
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.report import build_report
from oomguard.supervisor.run.loop import Supervisor

PY = sys.executable
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
    assert replan.start_at_fitted(PLAN, None, "job") is None and replan.start_at_fitted(PLAN, 16, "job") is None
    fitted = replan.start_at_fitted(PLAN, 8, "job x")
    assert fitted is not None and fitted.plan.batch.grad_accum == 8 and fitted.source is replan.Source.FIT_STORE
    grown = replan.grow(PLAN, 32)
    assert (grown.plan.batch.micro_batch, grown.plan.batch.grad_accum, grown.plan.batch.global_batch) == (32, 2, 64)
    assert grown.reason == "grow: micro-batch 16 -> 32 × accumulation 2"
    assert replan.planned_restart(PLAN, "forecast").plan == PLAN
    assert replan.allocator_from_environment(PLAN, False) is None
    alloc = replan.allocator_from_environment(PLAN, True)
    assert alloc is not None and alloc.plan.expandable_segments
    assert replan.allocator_from_environment(alloc.plan, True) is None  # already set: no change
    assert replan.agreed(PLAN, PLAN) is None
    node0 = replan.agreed(PLAN, Plan(BatchPlan(8, 64, 1)))
    assert node0 is not None and node0.source is replan.Source.AGREED
    decision = Decision(Action.RESTART, Plan(BatchPlan(8, 64, 1)), "cuda_oom at micro-batch 16")
    assert replan.after_failure(decision).reason == "cuda_oom at micro-batch 16"
    saved = replan.continue_saved(PLAN, {**Plan(BatchPlan(4, 64, 1)).as_dict()})
    assert saved is not None and saved.plan.batch.micro_batch == 4
    assert replan.continue_saved(PLAN, {**Plan(BatchPlan(4, 16, 1)).as_dict()}) is None  # another global batch


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


def _start(run_dir: Path, pidfile: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--no-web", "--micro-batch", "8",
                             "--grad-accum", "2", "--grace-period", "2", "--",
                             PY, WORKER, "pidfile", "--pidfile", str(pidfile)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_the_users_stop_ends_the_attempt_as_stopped_and_is_no_failure_in_the_next_run(tmp_path: Path) -> None:
    """Ctrl-C: the attempt is closed at once as stopped (by the user), not left open for the next
    supervisor to close as a failure; running the same command again finishes with no failure."""
    run_dir, pidfile = tmp_path / "run", tmp_path / "pid"
    proc = _start(run_dir, pidfile)
    try:
        _wait_for(pidfile)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT
    finally:
        proc.kill()
    journal = Journal(run_dir, readonly=True)
    try:
        (first,) = journal.attempts()
        assert first["ended"] is not None and first["kind"] is None
        assert (first["ending"], first["stop_reason"]) == ("stopped", "user")
        stops = [e["data"] for e in journal.events(limit=10_000) if e["kind"] == "worker_stop"]
        assert stops == [{"reason": "user", "detail": "stopped by SIGINT"}]
    finally:
        journal.close()
    pidfile.unlink()
    again = oomguard("run", "--run-dir", str(run_dir), "--no-web", "--micro-batch", "8", "--grad-accum", "2",
                     "--", PY, WORKER, "pidfile", "--pidfile", str(pidfile), timeout=60)
    assert again.returncode == 0, again.stderr
    assert "interrupted" not in again.stderr
    report = json.loads(oomguard("report", "--run-dir", str(run_dir), "--json").stdout)
    assert report["failures"] == [] and report["state"] == "succeeded"


def test_a_requested_restart_is_a_planned_restart_not_a_failure(tmp_path: Path) -> None:
    """The dashboard's restart button (``request_restart``) stops the worker with that reason; the
    next attempt runs the same plan, and the report counts no failure."""
    run_dir, pidfile = tmp_path / "run", tmp_path / "pid"
    options = vars(build_parser().parse_args(["run", "--run-dir", str(run_dir), "--no-web", "--micro-batch", "8",
                                              "--grad-accum", "2", "--grace-period", "2"]))
    config = build_config({k: v for k, v in options.items() if k not in ("func", "subcommand")},
                          [PY, WORKER, "pidfile", "--pidfile", str(pidfile)])
    sup = Supervisor(config)
    sup.open()
    codes: list[int] = []
    loop = threading.Thread(target=lambda: codes.append(sup.run()))
    loop.start()
    try:
        _wait_for(pidfile)
        sup.request_restart()
        loop.join(timeout=60)
        assert codes == [0]
        rows = sup.journal.attempts()
        assert [(r["ending"], r["stop_reason"]) for r in rows] == [("planned_restart", "restart_requested"),
                                                                   ("finished", None)]
        assert rows[0]["micro_batch"] == rows[1]["micro_batch"] == 8
        changes = [e["data"]["source"] for e in sup.journal.events(limit=10_000) if e["kind"] == "plan_change"]
        assert changes == ["planned_restart"]
        report = build_report(sup.journal)
        assert report["failures"] == [] and report["planned_restarts"] == []
    finally:
        sup.request_stop()
        loop.join(timeout=30)
        sup.close()


def test_a_bad_mark_is_for_one_write_a_rewrite_is_judged_on_its_own(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A torn ckpt-65 is marked bad; the script resumes from ckpt-60 and writes ckpt-65 whole when it gets
    there again: that write is a resume point (found by the kill -9 campaign, which saw ``resumed from
    ckpt-60, newest valid was ckpt-65``)."""
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt-000065.pt"
    ckpt.write_text("65 torn")
    os.utime(ckpt, (1_000_000, 1_000_000))
    options = vars(build_parser().parse_args(["run", "--run-dir", str(tmp_path / "run"), "--no-web", "--micro-batch",
                                              "1", "--grad-accum", "1", "--checkpoint", "ckpt-*.pt",
                                              "--resume-args", "--resume {checkpoint}"]))
    config = build_config({k: v for k, v in options.items() if k not in ("func", "subcommand")}, [PY, "-c", "pass"])
    sup = Supervisor(config)
    sup.open()
    try:
        sup.journal.checkpoint_seen(str(ckpt), 65, 1_000_000, 1)
        sup.journal.mark_bad(str(ckpt), "checkpoint is corrupt")
        assert sup._bad() == {str(ckpt)}  # the marked write is still there
        ckpt.write_text("65 whole END")
        os.utime(ckpt, (1_000_100, 1_000_100))
        assert sup._bad() == set()
        assert sup.journal.bad_checkpoints() == set()
        events = [e["data"] for e in sup.journal.events(limit=10_000) if e["kind"] == "checkpoint_rewritten"]
        assert events == [{"path": str(ckpt)}]
    finally:
        sup.close()
