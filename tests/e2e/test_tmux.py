"""`oomguard run` in a real tmux pane: the live status line beneath intact worker output, and
`oomguard stop` from another pane ending the run cleanly with a final checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ROOT, oomguard, status

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def wait_for(predicate, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.fixture
def session() -> Iterator[str]:
    name = f"oomguard-test-{os.getpid()}"
    yield name
    subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def test_status_line_in_tmux_and_stop_from_another_pane(session: str, tmp_path: Path) -> None:
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    command = (f"cd {ROOT} && PYTHONPATH={ROOT} OOMGUARD_CACHE_DIR={tmp_path}/cache {sys.executable} -m oomguard "
               f"run --run-dir {run_dir} --port 0 --global-batch 64 --micro-batch 64 --grace-period 20 "
               f"--checkpoint '{ckpt}/checkpoint-*' -- {sys.executable} examples/train_worker_demo.py "
               f"--checkpoint-dir {ckpt} --checkpoint-every 100000 --steps 1000000; sleep 30")
    tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "40", command)
    pane = f"{session}:0.0"
    wait_for(lambda: "step   20" in tmux("capture-pane", "-p", "-t", pane))
    first = tmux("capture-pane", "-p", "-t", pane)
    assert "running" in first and "64 × 1" in first.replace("x", "×")  # the status line
    wait_for(lambda: tmux("capture-pane", "-p", "-t", pane) != first)  # the worker goes on, the line is redrawn
    second = tmux("capture-pane", "-p", "-t", pane)
    worker_lines = [line for line in second.splitlines() if line.startswith("step ")]
    assert worker_lines and all("loss" in line and "micro-batch  64 x 1" in line for line in worker_lines)
    status_lines = [line for line in second.splitlines() if line.startswith("running · attempt 1")]
    assert len(status_lines) == 1  # one status line, redrawn in place
    assert not list(ckpt.glob("checkpoint-*"))

    tmux("split-window", "-t", session, f"cd {ROOT} && PYTHONPATH={ROOT} {sys.executable} -m oomguard stop "
         f"--run-dir {run_dir} > {tmp_path}/stop.out 2>&1; sleep 30")
    wait_for(lambda: status(run_dir)["state"] == "stopped")
    assert list(ckpt.glob("checkpoint-*")), "the worker wrote a final checkpoint when stopped"
    doc = status(run_dir)
    assert doc["failures"] == [] and doc["supervisor_alive"] in (True, False)
    assert "stop" in (tmp_path / "stop.out").read_text().lower()
    report = oomguard("report", "--run-dir", str(run_dir))
    assert report.returncode == 0 and "stopped" in report.stdout
