"""A damaged journal is one line naming the file and the fix, exit 2, and is never overwritten; an
attempt a killed supervisor left open is closed as interrupted at the next start."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT, oomguard

from oomguard.supervisor.record.journal import Journal

WORKER = str(Path(__file__).with_name("worker.py"))
RUN = ["--no-web", "--micro-batch", "1", "--grad-accum", "1", "--backoff", "0.05", "--max-backoff", "0.2"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("done") / "run"
    out = oomguard("run", "--run-dir", str(run_dir), *RUN, "--", sys.executable, WORKER, "sleep", "--seconds", "0")
    assert out.returncode == 0, out.stderr
    with sqlite3.connect(run_dir / "journal.sqlite") as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return run_dir


def damage(journal: Path, how: str) -> None:
    data = journal.read_bytes()
    for side in ("-wal", "-shm"):
        Path(str(journal) + side).unlink(missing_ok=True)
    if how == "garbage":
        journal.write_bytes(os.urandom(len(data)))
    elif how == "half":
        journal.write_bytes(data[:len(data) // 2])
    else:
        journal.write_bytes(b"")
        os.utime(journal, (time.time() - 60, time.time() - 60))  # not one being created this instant


@pytest.mark.parametrize("how", ["garbage", "half", "empty"])
def test_a_damaged_journal_is_one_line_and_never_overwritten(how: str, finished_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    journal = run_dir / "journal.sqlite"
    journal.write_bytes((finished_run / "journal.sqlite").read_bytes())
    damage(journal, how)
    before = hashlib.sha256(journal.read_bytes()).hexdigest()
    for args in (["status"], ["status", "--json"], ["report"], ["stop"], ["logs"],
                 ["run", *RUN, "--", sys.executable, WORKER, "sleep", "--seconds", "0"]):
        cmd = [args[0], "--run-dir", str(run_dir), *args[1:]]
        out = oomguard(*cmd)
        assert out.returncode == 2, (cmd, out.stdout, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, (cmd, out.stderr)
        assert str(journal) in out.stderr and "move it aside" in out.stderr, (cmd, out.stderr)
    assert hashlib.sha256(journal.read_bytes()).hexdigest() == before, "run overwrote the damaged journal"


def test_status_into_a_closed_pipe_is_quiet(finished_run: Path) -> None:
    out = subprocess.run(f"{sys.executable} -m oomguard status --run-dir {finished_run} | head -1", shell=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.stdout.startswith("state:") and out.stderr == "", out.stderr


def test_an_attempt_left_open_by_a_killed_supervisor_is_closed_as_interrupted(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sup = subprocess.Popen([sys.executable, "-m", "oomguard", "run", "--run-dir", str(run_dir), *RUN,
                            "--max-restarts", "0", "--", sys.executable, WORKER, "sleep", "--seconds", "60"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _running(run_dir):
        time.sleep(0.1)
    os.kill(sup.pid, signal.SIGKILL)
    sup.wait()
    assert Journal(run_dir, readonly=True).attempts()[0]["ended"] is None
    out = oomguard("run", "--run-dir", str(run_dir), *RUN, "--max-restarts", "0", "--", "false", "{micro_batch}")
    # a new invocation, a new budget: one crash with --max-restarts 0 fails for that crash alone
    assert out.returncode == 1 and "interrupted" in out.stderr, out.stderr
    attempts = Journal(run_dir, readonly=True).attempts()
    assert attempts[0]["decision"].startswith("interrupted") and attempts[0]["ended"] is not None
    assert attempts[0]["kind"] is None and attempts[1]["kind"] == "crash"
    with sqlite3.connect(run_dir / "journal.sqlite") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def _running(run_dir: Path) -> bool:
    try:
        return bool(Journal(run_dir, readonly=True).meta().get("state") == "running")
    except Exception:  # not created yet
        return False
