"""The kill -9 campaign, shared by the CI test (a few kills) and ``bench/faults.py`` (many).

A checkpointing worker trains under ``oomguard run``; the supervisor is killed with SIGKILL at random
instants (during a checkpoint write, a journal write, a restart's backoff) and started again on the
same run directory, until the run finishes. What must hold after every kill and at the end:

* no worker outlives its supervisor, and never two run at once (no duplicate worker);
* the journal passes ``PRAGMA integrity_check``;
* every attempt that trained resumed from the newest valid checkpoint there was (a torn one may be
  handed over once: the worker refuses it, and oomguard must then fall back, never retry it);
* the run ends succeeded.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[3]
WORKER = str(Path(__file__).with_name("worker.py"))


@dataclass
class Figures:
    kills: int = 0
    starts: int = 0
    duplicates: int = 0
    survivors: int = 0
    corruptions: int = 0  # journals failing integrity_check
    wrong_resumes: int = 0
    torn_retried: int = 0
    problems: list[str] = field(default_factory=list)


def _command(run_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--no-web", "--micro-batch", "1",
            "--grad-accum", "1", "--backoff", "0.05", "--max-backoff", "0.2", "--grace-period", "2",
            "--checkpoint", str(run_dir.parent / "ckpt" / "ckpt-*.pt"), "--resume-args", "--resume-from {checkpoint}",
            "--", sys.executable, WORKER, "ckpt_train", "--path", str(run_dir.parent / "ckpt"), "--steps", str(steps),
            "--every", "5", "--seconds", "0.04", "--record", str(run_dir.parent / "starts.txt")]


def workers(marker: str) -> list[psutil.Process]:
    """The training processes of this campaign (the launcher, whose argv repeats the command, excluded)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ckpt_train" in cmd and marker in cmd and "launch.py" not in cmd and "oomguard run" not in cmd \
                and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def integrity(run_dir: Path) -> str:
    with sqlite3.connect(run_dir / "journal.sqlite") as db:
        return str(db.execute("PRAGMA integrity_check").fetchone()[0])


def run(root: Path, kills: int, rng: random.Random, steps: int = 150) -> Figures:
    run_dir = root / "run"
    marker = str(root / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    figures = Figures()
    for round_ in range(kills + 1):
        sup = subprocess.Popen(_command(run_dir, steps), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        figures.starts += 1
        if round_ == kills:  # the last start runs to the end
            if sup.wait(120) != 0:
                figures.problems.append(f"the final run ended {sup.returncode}")
            break
        time.sleep(rng.uniform(0.6, 2.5))
        if sup.poll() is not None:
            # On a quiet machine the resumed run can finish before the next random instant comes: the
            # kills so far are what the campaign checks. Any other early end is a problem.
            if sup.returncode != 0:
                figures.problems.append(f"the run ended early ({sup.returncode}) before kill {round_ + 1}")
            break
        _check_one_worker(marker, figures)
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait()
        figures.kills += 1
        _check_none_left(marker, figures)
        if run_dir.joinpath("journal.sqlite").exists() and integrity(run_dir) != "ok":
            figures.corruptions += 1
    _check_resumes(root, figures)
    if integrity(run_dir) != "ok":
        figures.corruptions += 1
    return figures


def _check_one_worker(marker: str, figures: Figures) -> None:
    alive = workers(marker)
    if len(alive) > 1:
        figures.duplicates += 1
        figures.problems.append(f"{len(alive)} workers at once: {[p.pid for p in alive]}")


def _check_none_left(marker: str, figures: Figures) -> None:
    deadline = time.monotonic() + 10
    while (alive := workers(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive:
        figures.survivors += len(alive)
        figures.problems.append(f"workers outlived a kill -9 of the supervisor: {[p.pid for p in alive]}")
        for proc in alive:  # ours: do not leave them running
            proc.kill()


def _check_resumes(root: Path, figures: Figures) -> None:
    """Each start: given == the newest valid checkpoint, or a torn one handed over only once."""
    torn_seen: set[str] = set()
    record = root / "starts.txt"
    for line in record.read_text().splitlines() if record.exists() else []:
        _, given, newest, given_valid = line.split()
        if given == newest:
            continue
        if given != "-" and given_valid == "0":
            if given in torn_seen:
                figures.torn_retried += 1
                figures.problems.append(f"a torn checkpoint was handed over twice: {given}")
            torn_seen.add(given)
            continue
        figures.wrong_resumes += 1
        figures.problems.append(f"resumed from {given}, newest valid was {newest}")
