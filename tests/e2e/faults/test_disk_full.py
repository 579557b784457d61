"""A full disk under oomguard's own files (journal, logs) never stops supervision nor the worker; a
worker that dies of it gets the failure kind ``disk_full``. Real tmpfs mounts, really full."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from support import ROOT, oomguard

from oomguard.supervisor.record.journal import Degradations, Journal, ResilientJournal
from oomguard.supervisor.record.logs import AttemptLog

WORKER = str(Path(__file__).with_name("worker.py"))
FAST = ["--no-web", "--micro-batch", "1", "--grad-accum", "1", "--backoff", "0.05", "--max-backoff", "0.2"]


def fill(where: Path) -> Path:
    filler = where / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 16))
                fh.flush()
        except OSError:
            pass
    return filler


def integrity(run_dir: Path) -> str:
    with sqlite3.connect(run_dir / "journal.sqlite") as db:
        return str(db.execute("PRAGMA integrity_check").fetchone()[0])


def test_journal_writes_degrade_on_a_full_disk_and_catch_up(tmpfs: Callable[[str], Path]) -> None:
    where = tmpfs("8m")
    said: list[str] = []
    journal = ResilientJournal(where, Degradations(said.append), probe_every=0.0)
    journal.set_meta(state="running")
    filler = fill(where)
    for i in range(200):  # enough to need new pages: the WAL cannot grow
        journal.record_sample(1, {"worker_rss_bytes": i, "pad": "p" * 500}, float(i), i, None, None, None)
        journal.event("note", 1, i=i, pad="p" * 500)
    journal.transition("running", "recovering", "while the disk was full", 1)
    assert journal.pending > 0, "important writes are kept while the disk is full"
    assert [s for s in said if "journal degraded" in s and "disk is full" in s], said
    assert len([s for s in said if "journal degraded:" in s]) == 1, "said once, not per write"
    filler.unlink()
    journal.set_meta(state="recovering")
    assert journal.pending == 0
    assert [s for s in said if "journal recovered" in s], said
    reader = Journal(where, readonly=True)
    kinds = [e["kind"] for e in reader.events(limit=10_000)]
    assert "degraded" in kinds and kinds.count("note") == 200
    assert any(e["data"].get("reason") == "while the disk was full" for e in reader.events(limit=10_000))
    assert reader.meta()["state"] == "recovering"
    assert integrity(where) == "ok"


def test_the_log_drops_output_on_a_full_disk_and_says_how_much(tmpfs: Callable[[str], Path]) -> None:
    where = tmpfs("1m")
    said: list[str] = []
    problems = Degradations(said.append)
    log = AttemptLog(where / "attempt-1.log", problems=problems)
    filler = fill(where)
    log.write(b"lost line\n" * 1000)
    log.flush()  # must not raise
    assert problems.is_degraded("log") and len(said) == 1
    filler.unlink()
    log._next_probe = 0.0  # the next flush probes at once (normally 2 s later)
    log.write(b"after\n")
    log.close()
    text = (where / "attempt-1.log").read_text()
    assert "bytes of output were lost" in text and text.endswith("after\n")
    assert not problems.is_degraded("log")


def test_log_max_bytes_keeps_head_and_tail(tmp_path: Path) -> None:
    log = AttemptLog(tmp_path / "a.log", max_bytes=100_000)
    for i in range(20_000):
        log.write(f"line {i:06d}\n".encode())
    log.close()
    data = (tmp_path / "a.log").read_bytes()
    assert len(data) <= 100_000 + 200
    assert data.startswith(b"line 000000\n") and data.endswith(b"line 019999\n")
    assert b"output cut here" in data


def test_a_full_run_dir_does_not_stop_supervision_nor_the_worker(tmpfs: Callable[[str], Path]) -> None:
    where = tmpfs("20m")
    run_dir = where / "run"
    opts = [o for o in FAST if o != "--no-web"]
    sup = subprocess.Popen([sys.executable, "-m", "oomguard", "run", "--run-dir", str(run_dir), *opts, "--port", "0",
                            "--sample-interval", "0.2", "--", sys.executable, WORKER, "fill_disk", "--path", str(where),
                            "--seconds", "5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    shown = ""
    while sup.poll() is None and "journal: database or disk is full" not in shown:
        shown = oomguard("status", "--run-dir", str(run_dir)).stdout  # the API's, while the journal lags
        time.sleep(0.2)
    _, err = sup.communicate(timeout=120)
    assert sup.returncode == 0, err[-3000:]
    assert "degraded:   journal: database or disk is full" in shown, shown
    assert "Traceback" not in err, err[-3000:]
    assert "degraded" in err and "recovered" in err, err[-3000:]
    assert integrity(run_dir) == "ok"
    journal = Journal(run_dir, readonly=True)
    attempts = journal.attempts()
    assert len(attempts) == 1 and attempts[0]["decision"] == "finished", attempts
    assert "degraded" in [e["kind"] for e in journal.events(limit=100_000)]
    log = (run_dir / "logs" / "attempt-1.log").read_text()
    assert "space freed" in log and "done" in log


def test_a_worker_that_dies_of_enospc_is_disk_full(tmpfs: Callable[[str], Path], run_dir: Path) -> None:
    ckpts = tmpfs("4m")
    done = oomguard("run", "--run-dir", str(run_dir), *FAST, "--max-restarts", "0", "--",
                    sys.executable, WORKER, "checkpoint_enospc", "--path", str(ckpts), timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    failures = Journal(run_dir, readonly=True).attempts()
    assert failures[0]["kind"] == "disk_full", failures
    assert "No space left on device" in failures[0]["evidence"]
