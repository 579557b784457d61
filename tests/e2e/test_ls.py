"""``oomguard ls`` on real runs: one that finished after a real OOM, one whose supervisor is alive with its
dashboard and then killed with SIGKILL, and a damaged journal
(the rest: tests/unit/supervisor/record/test_status.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from support import ROOT, WORKER, oomguard

from oomguard.supervisor.record import status as runs
from oomguard.supervisor.record.journal import Journal


def _ls(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    out = oomguard("ls", *args, cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    return out


def _rows(cwd: Path, *dirs: str) -> dict[str, dict[str, Any]]:
    return {Path(r["run_dir"]).name: r for r in json.loads(_ls(*dirs, "--json", cwd=cwd).stdout)}


def _line(table: str, name: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"runs/{name} "))


def _start_hanging(run_dir: Path, cwd: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--port", "0", "--micro-batch", "8",
            "--grad-accum", "2", "--", sys.executable, WORKER, "hang"]
    return subprocess.Popen(argv, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _wait_alive(cwd: Path, name: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = _rows(cwd).get(name)
        if row and row["supervisor"] == "alive" and row["dashboard"] and row["state"] == "running":
            return row
        time.sleep(0.2)
    raise AssertionError(f"{name} never showed as running: {_rows(cwd)}")


def test_ls_lists_finished_alive_killed_and_damaged_runs(tmp_path: Path) -> None:
    finished = oomguard("run", "--run-dir", "runs/gpt-small", "--no-web", "--micro-batch", "8", "--grad-accum",
                        "1", "--", sys.executable, WORKER, "torch_oom", "--fail-above", "4", cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    damaged = tmp_path / "runs" / "broken" / "journal.sqlite"
    damaged.parent.mkdir()
    damaged.write_bytes(b"this is not SQLite" * 100)
    os.utime(damaged, (time.time() - 3600, time.time() - 3600))
    hidden = tmp_path / "runs" / ".trash" / "old"
    hidden.mkdir(parents=True)
    Journal(hidden).close()  # hidden directories are not searched
    proc = _start_hanging(tmp_path / "runs" / "llama", tmp_path)
    try:
        alive = _wait_alive(tmp_path, "llama")
        table = _ls(cwd=tmp_path).stdout
        proc.kill()
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait(10)
    assert alive["supervisor_pid"] == proc.pid and alive["dashboard"].startswith("http://127.0.0.1:")
    assert table.splitlines()[0].split() == list(runs.COLUMNS)
    assert len(table.splitlines()) == 4, table  # the header and three runs; .trash is not searched
    llama = _line(table, "llama").split()
    assert llama[:7] == ["runs/llama", "running", "1", "8", "×", "2", "×"]
    assert f"alive (pid {proc.pid})" in _line(table, "llama") and alive["dashboard"] in _line(table, "llama")
    small = _line(table, "gpt-small")
    assert " succeeded " in small and " 4 × 2 × 1 = 8 " in small and " 1 (cuda_oom) " in small
    assert " exited " in small and small.endswith("worker finished (attempt 2)")
    assert "damaged" in _line(table, "broken") and "it is not an SQLite database" in _line(table, "broken")

    after = _rows(tmp_path, "runs")
    assert after["llama"]["supervisor"] == "gone" and after["llama"]["dashboard"] is None
    assert after["gpt-small"]["failure_kinds"] == {"cuda_oom": 1} and after["gpt-small"]["global_batch"] == 8
    assert after["broken"]["state"] == "damaged" and "Traceback" not in after["broken"]["error"]
    gone = _line(_ls(cwd=tmp_path).stdout, "llama")
    assert f"the supervisor (pid {proc.pid}) is gone; it last recorded: attempt 1" in gone
