"""Spares under real ``oomguard run``: stopping or killing the supervisor ends the spare, an OOM restarts
through the spare with the global batch kept, back-to-back OOMs find a reserve that has imported, and
without spares every worker starts cold (the spare itself is in tests/unit/supervisor/run/test_spare.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from support import ROOT
from support_spare import env_for, make_project, wait_until

from oomguard.supervisor.record.journal import Journal

PY = sys.executable


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_project(tmp_path)


def supervise(project: Path, run_dir: Path, *opts: str, worker: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--no-web", "--backoff", "0",
                             *opts, "--", PY, *worker], cwd=project, env=env_for(project), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def oomguard_run(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "oomguard", "run", *args], cwd=project, env=env_for(project), text=True,
                          capture_output=True, timeout=300)


def journal_events(run_dir: Path, prefix: str = "spare") -> list[dict[str, Any]]:
    journal = Journal(run_dir, readonly=True)
    try:
        return [e for e in journal.events() if e["kind"].startswith(prefix)]
    finally:
        journal.close()


def spare_pids(run_dir: Path, count: int = 1) -> list[int]:
    """The launchers' pids (their events) and the spare interpreters' (their ready records) of the
    first ``count`` spares, once ready."""
    pids = []
    for n in range(1, count + 1):
        ready = run_dir / "spare" / f"ready-{n}.json"
        wait_until(ready.exists)
        started = journal_events(run_dir, "spare_started")
        pids += [started[n - 1]["data"]["pid"], json.loads(ready.read_text())["pid"]]
    return pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_or_killing_the_supervisor_ends_the_spare(project: Path, sig: signal.Signals) -> None:
    (project / "sleep.py").write_text("import heavymod, time\nprint('up', flush=True)\ntime.sleep(300)\n")
    run_dir = project / "run"
    sup = supervise(project, run_dir, "--micro-batch", "1", "--global-batch", "1", worker=["sleep.py", "{micro_batch}"])
    try:
        pids = spare_pids(run_dir, 2)  # the next attempt's spare and the reserve
        os.kill(sup.pid, sig)
        sup.wait(60)
        for pid in pids:
            wait_until(lambda pid=pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", 30)
    finally:
        sup.kill()
        sup.wait(30)


def test_an_oom_restarts_through_the_spare_and_keeps_the_global_batch(project: Path) -> None:
    (project / "train.py").write_text(
        "import sys\nprewarmed = 'heavymod' in sys.modules\nimport heavymod\n"
        "micro, accum = int(sys.argv[2]), int(sys.argv[4])\n"
        "print(f'trained micro={micro} accum={accum} global={micro * accum} prewarmed={prewarmed}', flush=True)\n"
        "if micro > 2:\n"
        "    raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')\n")
    run_dir = project / "run"
    out = oomguard_run(project, "--run-dir", str(run_dir), "--no-web", "--backoff", "0", "--micro-batch", "8",
                       "--global-batch", "16", "--", PY, "train.py", "--mb", "{micro_batch}", "--ga", "{grad_accum}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "trained micro=8 accum=2 global=16 prewarmed=False" in out.stdout
    assert "trained micro=4 accum=4 global=16 prewarmed=True" in out.stdout
    assert "trained micro=2 accum=8 global=16 prewarmed=True" in out.stdout
    assert [e["kind"] for e in journal_events(run_dir)].count("spare_used") == 2
    assert not list((run_dir / "spare").glob("ready-*.json"))  # the last spare was discarded


def test_after_back_to_back_ooms_the_next_worker_finds_a_reserve_that_has_imported(project: Path) -> None:
    """The second restart follows an attempt from a spare that lived well under a second: the spare
    started with that attempt cannot have imported, the reserve (started once the first spare was
    ready, while the cold first attempt ran) has. The first attempt waits for the reserve's ready
    record, so this holds on a loaded machine too; with one spare an attempt, it never appears."""
    run_dir = project / "run"
    reserve_ready = run_dir / "spare" / "ready-2.json"
    out = oomguard_run(project, "--run-dir", str(run_dir), "--no-web", "--backoff", "0", "--micro-batch", "8",
                       "--global-batch", "16", "--", PY, str(ROOT / "tests" / "workers" / "backtoback.py"),
                       "--mb", "{micro_batch}", "--ga", "{grad_accum}", "--wait-for", str(reserve_ready))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "attempt micro=8 accum=2 prewarmed=False" in out.stdout
    assert "reserve ready=True" in out.stdout  # a second spare had imported while the cold attempt ran
    assert "attempt micro=4 accum=4 prewarmed=True" in out.stdout
    assert "attempt micro=2 accum=8 prewarmed=True" in out.stdout and "trained micro=2 accum=8" in out.stdout
    spare_events = journal_events(run_dir)
    used = [e["data"] for e in spare_events if e["kind"] == "spare_used"]
    assert len(used) == 2 and all(u.get("ready") for u in used), spare_events  # no handover waited for imports
    started = [e["data"] for e in spare_events if e["kind"] == "spare_started"]
    assert [s["reserve"] for s in started[:2]] == [False, True]
    alive = 0
    for e in spare_events:  # never more than two spares at once
        alive += {"spare_started": 1, "spare_used": -1, "spare_not_used": -1}.get(e["kind"], 0)
        assert alive <= 2
    assert not list((run_dir / "spare").glob("ready-*.json"))  # the spares left were discarded


def test_no_spare_starts_every_worker_cold(project: Path) -> None:
    (project / "ok.py").write_text("print('fine')\n")
    run_dir = project / "run"
    out = oomguard_run(project, "--run-dir", str(run_dir), "--no-web", "--no-spare", "--micro-batch", "1",
                       "--global-batch", "1", "--", PY, "ok.py", "{micro_batch}")
    assert out.returncode == 0, out.stderr
    assert journal_events(run_dir) == []
