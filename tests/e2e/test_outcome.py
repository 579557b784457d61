"""Real runs whose worker oomguard stops for a reason: the user's stop, a requested restart, a bad mark on one
write (the pure ``ending_of`` and the journal's columns are in tests/unit/supervisor/test_lifecycle.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import ROOT, WORKER, oomguard

from oomguard.supervisor.cli import build_parser
from oomguard.supervisor.config import build_config
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.report import build_report
from oomguard.supervisor.run.loop import Supervisor

PY = sys.executable


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
        assert sup.parts.resume.bad() == {str(ckpt)}  # the marked write is still there
        ckpt.write_text("65 whole END")
        os.utime(ckpt, (1_000_100, 1_000_100))
        assert sup.parts.resume.bad() == set()
        assert sup.journal.bad_checkpoints() == set()
        events = [e["data"] for e in sup.journal.events(limit=10_000) if e["kind"] == "checkpoint_rewritten"]
        assert events == [{"path": str(ckpt)}]
    finally:
        sup.close()
