"""Operator commands say what happened, with real processes: ``oomguard checkpoint`` waits for the
checkpoint and says when the worker has no handler for the signal; ``oomguard status`` names the
training process, not oomguard's launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from support import ROOT, oomguard, status

PY = sys.executable
# Trains until told to stop; with "handler", writes ck/step-N on SIGUSR1 (as the worker library does).
WORKER = '''
import os, signal, sys, time
from pathlib import Path

micro = int(os.environ["OOMGUARD_MICRO_BATCH"])
step = 0
def save(*_):
    Path("ck").mkdir(exist_ok=True)
    Path(f"ck/step-{step}").write_text(str(step))
if sys.argv[1] == "handler":
    signal.signal(signal.SIGUSR1, save)
else:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # ignored, not handled: the request is only a file
while not Path("done").exists():
    step += 1
    print(f"step {step}", flush=True)
    time.sleep(0.2)
'''


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(mode: str) -> Path:
        work = tmp_path / mode
        work.mkdir()
        (work / "train.py").write_text(WORKER)
        procs.append(subprocess.Popen(
            [PY, "-m", "oomguard", "run", "--run-dir", "run", "--port", "0", "--micro-batch", "8", "--grad-accum",
             "1", "--checkpoint", "ck/step-*", "--resumes-itself", "--", PY, "train.py", mode],
            cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)}))
        deadline = time.monotonic() + 60
        while not _started(work / "run"):
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        return work

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def _started(run_dir: Path) -> bool:
    if not (run_dir / "journal.sqlite").exists():
        return False
    doc = status(run_dir)
    return doc["state"] == "running" and bool(doc["worker_pid"])


def test_checkpoint_waits_for_the_file_and_status_names_the_training_process(running: Callable[[str], Path]) -> None:
    work = running("handler")
    doc = status(work / "run")
    worker = psutil.Process(doc["worker_pid"])
    assert worker.cmdline()[-2:] == ["train.py", "handler"]  # the training process, not launch.py
    assert f"worker pid: {doc['worker_pid']} (" in oomguard("status", "--run-dir", "run", cwd=work).stdout
    out = oomguard("checkpoint", "--run-dir", "run", "--wait", "60", cwd=work, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "checkpoint written: " in out.stdout and "ck/step-" in out.stdout


def test_checkpoint_says_the_worker_has_no_handler_and_fails_when_nothing_is_written(
        running: Callable[[str], Path]) -> None:
    work = running("none")
    out = oomguard("checkpoint", "--run-dir", "run", "--wait", "3", cwd=work, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the worker has no handler for SIGUSR1" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("no checkpoint appeared within 3 s")
    assert not (work / "ck").exists()


def test_each_ranks_training_process_is_named_not_its_data_loader_workers(tmp_path: Path) -> None:
    """As torchrun starts them: a launcher, one process per rank with RANK set, and each rank's
    own child (a DataLoader worker) that inherits RANK."""
    import threading

    from oomguard.supervisor.run.process import WorkerProcess

    rank = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)")
    launcher = (f"import os, subprocess, sys, time; ps = [subprocess.Popen([sys.executable, '-c', {rank!r}], "
                "env={**os.environ, 'RANK': str(r)}) for r in (0, 1)]; time.sleep(60)")
    worker = WorkerProcess([PY, "-c", launcher], dict(os.environ), tmp_path, tmp_path / "log", lambda line: None, None)
    worker.start(threading.Event())
    try:
        deadline = time.monotonic() + 30
        while len(worker.tree()) < 5:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        named = worker.named_pids()
        assert named is not None and named["worker_pid"] == worker.tree()[0].pid  # the launcher's child
        ranks = {int(r): psutil.Process(p) for r, p in named["rank_pids"].items()}  # type: ignore[attr-defined]
        assert sorted(ranks) == [0, 1]
        assert all(p.ppid() == named["worker_pid"] for p in ranks.values())  # the rank, not its child
        assert worker.named_pids() is None  # unchanged: nothing to write again
    finally:
        worker.stop(1.0)


# Its torch.save is the evidence that it wrote them (the probe's save records): a file another process
# writes under the directory is never named (tests/e2e/test_wiring.py).
MISSED = '''
import os, sys, time
from pathlib import Path
import torch

micro = int(os.environ["OOMGUARD_MICRO_BATCH"])
step = 0
while not Path("done").exists() and step < 600:
    step += 1
    print(f"step {step}", flush=True)
    if step == 2:
        Path("ck").mkdir(exist_ok=True)
        torch.save({"step": 2}, "ck/step-2.pt")  # the glob matches this one
    if step == 4:
        Path("ck4").mkdir(exist_ok=True)
        torch.save({"step": 4}, "ck4/step-4.pt")  # and misses this one
    time.sleep(0.1)
'''


def test_a_checkpoint_the_glob_misses_is_said_while_the_attempt_that_wrote_it_runs(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(MISSED)
    proc = subprocess.Popen([PY, "-m", "oomguard", "run", "--run-dir", "run", "--no-web", "--micro-batch", "8",
                             "--grad-accum", "1", "--checkpoint", "ck/step-*.pt", "--resumes-itself", "--",
                             PY, "train.py"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not ((tmp_path / "run" / "journal.sqlite").exists() and status(tmp_path / "run")["warnings"]):
            assert time.monotonic() < deadline and proc.poll() is None, "no warning while the attempt ran"
            time.sleep(0.2)
        doc = status(tmp_path / "run")
        assert doc["state"] == "running" and doc["attempt"] == 1  # said during the attempt that wrote it
        [warning] = doc["warnings"]
        assert warning["message"] == (
            "--checkpoint 'ck/step-*.pt' does not match ck4/step-4.pt, which the script wrote and which looks like a "
            "checkpoint: a restart would not resume from it; use --checkpoint 'ck4/step-*.pt'")
        (tmp_path / "done").write_text("")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert proc.stderr is not None and proc.stderr.read().count(warning["message"]) == 1
    listed = oomguard("ls", cwd=tmp_path).stdout.splitlines()[1]
    assert "succeeded, 1 warning" in listed and "warning: --checkpoint 'ck/step-*.pt' does not match" in listed


def test_a_wrapper_shell_is_not_named_its_training_process_is(tmp_path: Path) -> None:
    import threading

    from oomguard.supervisor.run.process import WorkerProcess

    # "; true": the shell cannot exec the python, so it stays as its parent
    worker = WorkerProcess(["sh", "-c", f"{PY} -c 'import time; time.sleep(60)'; true"], dict(os.environ), tmp_path,
                           tmp_path / "log", lambda line: None, None)
    worker.start(threading.Event())
    try:
        deadline = time.monotonic() + 30
        while len(worker.tree()) < 2:
            assert time.monotonic() < deadline, "the script did not start"
            time.sleep(0.1)
        named = worker.named_pids()
        assert named is not None and psutil.Process(named["worker_pid"]).name().startswith("python")  # type: ignore[arg-type]
    finally:
        worker.stop(1.0)
