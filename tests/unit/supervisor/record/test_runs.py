"""``oomguard ls``: every run under some directories, found by its journal, one line each.

End to end on real runs: one that finished after a real OOM, one whose supervisor is alive with its
dashboard and then killed with SIGKILL, a damaged journal and one being created at this instant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, WORKER, oomguard

from oomguard.supervisor.record import runs
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


def test_a_run_directory_itself_and_bad_dirs(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "journal.sqlite").write_bytes(b"")  # created this instant, no schema yet
    rows = json.loads(_ls(str(tmp_path / "run"), "--json", cwd=tmp_path).stdout)
    assert [r["run_dir"] for r in rows] == [str(tmp_path / "run")]
    assert rows[0]["state"] == "starting" and rows[0]["reason"] == "the journal is being created"
    assert _ls("--depth", "0", cwd=tmp_path).stdout.startswith("no oomguard runs under")
    missing = oomguard("ls", str(tmp_path / "nope"), cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "is not a directory" in missing.stderr
    negative = oomguard("ls", "--depth", "-1", cwd=tmp_path)
    assert negative.returncode == 2 and "--depth" in negative.stderr


def test_nothing_found_is_said(tmp_path: Path) -> None:
    out = _ls(cwd=tmp_path)
    assert out.stdout.startswith("no oomguard runs under ")


def test_find_runs_depth_and_skips(tmp_path: Path) -> None:
    for rel in ("a/run", "a/b/c/d/run", "a/b/c/d/e/run", "node_modules/x/run", ".hidden/run", "a/run/nested"):
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel / "journal.sqlite").write_bytes(b"")
    found = [p.relative_to(tmp_path).as_posix() for p in runs.find_runs([tmp_path, tmp_path / "a"])]
    assert found == ["a/b/c/d/run", "a/run"]  # 5 levels is past the default 4; a run's inside is not searched
    assert [p.name for p in runs.find_runs([tmp_path], max_depth=6)] == ["run", "run", "run"]


ROW: dict[str, Any] = {
    "run_dir": "/r/runs/exp1", "state": "running", "reason": "recovered", "supervisor": "alive",
    "supervisor_pid": 41, "attempt": 3, "micro_batch": 4, "grad_accum": 16, "world_size": 1, "global_batch": 64,
    "failures": 2, "failure_kinds": {"cuda_oom": 2}, "checkpoint": "/r/ckpt/step-40.pt", "checkpoint_step": 40,
    "step": 47, "total_steps": 100, "progress_time": 995.0, "samples_per_s": 40.0, "updated": 999.0,
    "dashboard": "http://127.0.0.1:8765/", "degraded": ["journal: database or disk is full"], "warnings": [],
    "error": None,
}


@pytest.mark.parametrize(("seconds", "text"), [(3, "3 s ago"), (240, "4 min ago"), (7300, "2 h ago"),
                                               (200000, "2 d ago"), (-5, "0 s ago")])
def test_ago(seconds: float, text: str) -> None:
    assert runs.ago(seconds) == text


def test_format_one_line_each() -> None:
    gone = {**ROW, "run_dir": "/elsewhere/exp2", "supervisor": "gone", "dashboard": None, "degraded": [],
            "failure_kinds": {"cuda_oom": 1, "hang": 1}, "step": None}
    lines = runs.format_runs([ROW, gone], now=1000.0, cwd=Path("/r")).splitlines()
    assert lines[1].split("  ")[0] == "runs/exp1"
    for text in ("4 × 16 × 1 = 64", "2 (cuda_oom ×2)", "step-40.pt (step 40)", "step 47/100 (5 s ago)",
                 "alive (pid 41)", "http://127.0.0.1:8765/", "recovered; degraded: journal: database or disk is full"):
        assert text in lines[1]
    assert lines[2].startswith("/elsewhere/exp2 ") and "2 (cuda_oom, hang)" in lines[2]
    assert lines[2].endswith("the supervisor (pid 41) is gone; it last recorded: recovered")
    assert lines[0].index("DASHBOARD") == lines[1].index("http://")  # columns line up
    warned = {**ROW, "state": "succeeded", "reason": "worker finished (attempt 1)", "supervisor": "exited",
              "warnings": ["--checkpoint 'ck/*.pt' matches nothing, but the script wrote out/step-5.pt: ..."]}
    line = runs.format_runs([warned], now=1000.0, cwd=Path("/r")).splitlines()[1]
    assert "succeeded, 1 warning " in line  # not plainly succeeded
    assert line.endswith("warning: --checkpoint 'ck/*.pt' matches nothing, but the script wrote out/step-5.pt: ...; "
                         "worker finished (attempt 1); degraded: journal: database or disk is full")
