"""``oomguard ls``: every run under some directories, found by its journal, one line each.

End to end on real runs: one that finished after a real OOM, one whose supervisor is alive with its
dashboard and then killed with SIGKILL, a damaged journal and one being created at this instant."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support import oomguard

from oomguard.supervisor.record import status


def _ls(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    out = oomguard("ls", *args, cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    return out


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
    found = [p.relative_to(tmp_path).as_posix() for p in status.find_runs([tmp_path, tmp_path / "a"])]
    assert found == ["a/b/c/d/run", "a/run"]  # 5 levels is past the default 4; a run's inside is not searched
    assert [p.name for p in status.find_runs([tmp_path], max_depth=6)] == ["run", "run", "run"]


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
    assert status.ago(seconds) == text


def test_format_one_line_each() -> None:
    gone = {**ROW, "run_dir": "/elsewhere/exp2", "supervisor": "gone", "dashboard": None, "degraded": [],
            "failure_kinds": {"cuda_oom": 1, "hang": 1}, "step": None}
    lines = status.format_runs([ROW, gone], now=1000.0, cwd=Path("/r")).splitlines()
    assert lines[1].split("  ")[0] == "runs/exp1"
    for text in ("4 × 16 × 1 = 64", "2 (cuda_oom ×2)", "step-40.pt (step 40)", "step 47/100 (5 s ago)",
                 "alive (pid 41)", "http://127.0.0.1:8765/", "recovered; degraded: journal: database or disk is full"):
        assert text in lines[1]
    assert lines[2].startswith("/elsewhere/exp2 ") and "2 (cuda_oom, hang)" in lines[2]
    assert lines[2].endswith("the supervisor (pid 41) is gone; it last recorded: recovered")
    assert lines[0].index("DASHBOARD") == lines[1].index("http://")  # columns line up
    warned = {**ROW, "state": "succeeded", "reason": "worker finished (attempt 1)", "supervisor": "exited",
              "warnings": ["--checkpoint 'ck/*.pt' matches nothing, but the script wrote out/step-5.pt: ..."]}
    line = status.format_runs([warned], now=1000.0, cwd=Path("/r")).splitlines()[1]
    assert "succeeded, 1 warning " in line  # not plainly succeeded
    assert line.endswith("warning: --checkpoint 'ck/*.pt' matches nothing, but the script wrote out/step-5.pt: ...; "
                         "worker finished (attempt 1); degraded: journal: database or disk is full")
