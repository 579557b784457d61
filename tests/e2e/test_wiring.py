"""The wiring mistakes new users make, end to end: the real CLI, real worker processes and a real
allocator OOM (RLIMIT_AS, so PyTorch's CPU allocator fails with ``DefaultCPUAllocator: can't allocate
memory``). Each mistake is refused at start in one line, or said at once while the run goes, journaled,
notified once, and the report counts the steps the script really redid (read from its own output).
A stop the user asked for (Ctrl-C, ``oomguard stop``) is no failure, whichever supervisor closes it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, WORKERS, oomguard, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
SCRIPT = WORKERS / "wiring.py"
# No spare interpreters: this file checks no spare, and each spare imports torch again beside the worker
# (spares have their own tests: test_spare*.py, test_ownfault.py, the frameworks' and probe matrices' default runs).
FAST = ["--no-web", "--no-spare", "--backoff", "0.05", "--max-backoff", "0.2"]
_STEP = re.compile(r"^step (\d+)/\d+", re.MULTILINE)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A project directory holding the user's script, as ``train.py``."""
    (tmp_path / "train.py").write_text(SCRIPT.read_text())
    return tmp_path


def run(work: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return oomguard("run", "--run-dir", str(work / "run"), *FAST, *args, cwd=work, timeout=timeout)


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    journal = Journal(run_dir, readonly=True)
    try:
        return [e for e in journal.events(0, 100000) if e["kind"] == kind]
    finally:
        journal.close()


def report(run_dir: Path) -> dict[str, Any]:
    out = oomguard("report", "--run-dir", str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def really_redone(run_dir: Path) -> list[int]:
    """Per failure, the steps the next attempt printed again (from the attempts' own output)."""
    logs = sorted((run_dir / "logs").glob("attempt-*.log"), key=lambda p: int(p.stem.split("-")[1]))
    steps = [[int(s) for s in _STEP.findall(p.read_text())] for p in logs]
    return [sum(1 for s in after if s <= max(before, default=0))
            for before, after in zip(steps, steps[1:], strict=False)]


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook", received
    server.shutdown()


# --- refused at start: one line, exit 2, nothing started --------------------------------------------


def refused(work: Path, *argv: str) -> str:
    out = oomguard(*argv, cwd=work)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and out.stdout == "", out.stdout + out.stderr
    assert not (work / "run").exists(), "nothing is started for bad input"
    return out.stderr.strip()


RUN = ["run", "--run-dir", "run", "--no-web", "--micro-batch", "32", "--grad-accum", "1"]


def test_checkpoints_nothing_hands_over_are_refused(work: Path) -> None:
    """The night the issue tells of: --checkpoint given, --resume-args forgotten."""
    line = refused(work, *RUN, "--checkpoint", "out/step-*.pt", "--", PY, "train.py", "--batch-size", "{micro_batch}")
    assert line == (
        "oomguard: error: --checkpoint: 'out/step-*.pt' is watched, but nothing hands the checkpoint to the script, "
        "so every restart would start over at step 1 (no {checkpoint} or {checkpoint_step} in the command, no "
        "--resume-args or --edit, and train.py does not use oomguard's worker library); add your script's resume "
        "flag, e.g. --resume-args '--resume {checkpoint}', or --resumes-itself if the script finds its checkpoint "
        "by itself")


def test_a_script_that_does_not_exist_is_refused(work: Path) -> None:
    line = refused(work, *RUN, "--", PY, "trian.py", "--batch-size", "{micro_batch}")
    assert line == f"oomguard: error: COMMAND: the script trian.py does not exist (in {work}); check the path: " \
                   "did you mean train.py?"


def test_a_forgotten_double_dash_is_named(work: Path) -> None:
    line = refused(work, *RUN, PY, "train.py", "--batch-size", "8")
    assert line == (f"oomguard: error: unrecognized arguments: {PY} train.py --batch-size 8; put -- before the "
                    f"training command: oomguard {' '.join(RUN)} -- {PY} train.py --batch-size 8; "
                    "see 'oomguard --help'")


def test_service_refuses_what_run_would_and_writes_no_unit(work: Path) -> None:
    line = refused(work, "service", "--print", "--", "--micro-bach", "32", "--", PY, "train.py")
    assert line == ("oomguard service: error: in the oomguard run arguments: unrecognized arguments: --micro-bach 32 "
                    "(did you mean --micro-batch?); see 'oomguard run --help'")
    line = refused(work, "service", "--print", "--", "--micro-batch", "32", "--grad-accum", "1",
                   "--checkpoint", "out/step-*.pt", "--", PY, "train.py")
    assert "nothing hands the checkpoint to the script" in line


# --- said while the run goes -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_resume_the_script_ignores_is_said_at_once_and_counted(
        work: Path, webhook: tuple[str, list[dict[str, Any]]]) -> None:
    """A mistyped resume flag the script ignores: every restart starts over at step 1. Micro-batch 32
    and 16 fail at step 8 in the allocator, 8 fits: two restarts, each from step-6.pt."""
    url, received = webhook
    out = run(work, "--notify", url, "--micro-batch", "32", "--global-batch", "32", "--checkpoint", "out/step-*.pt",
              "--allow-smaller-global-batch",  # the script takes no accumulation (issue 20)
              "--resume-args", "--resume-from {checkpoint}", "--",
              PY, "train.py", "--batch-size", "{micro_batch}", "--budget-mb", "100", "--step-seconds", "0.05")
    assert out.returncode == 0, out.stderr[-3000:]
    said = "[oomguard] the script started over at step 1, not from step-6.pt: check --resume-args"
    assert out.stderr.count(said) == 2, out.stderr  # at each restart that did not resume
    assert "ignoring unknown arguments: --resume-from" in out.stdout  # the script's own word, easy to miss
    assert "InotifyEmitter" not in out.stderr  # watchdog's stop race, once printed after the run
    run_dir = work / "run"
    missed = events(run_dir, "not_resumed")
    assert [(e["attempt"], e["data"]["step"], e["data"]["first_step"]) for e in missed] == [(2, 6, 1), (3, 6, 1)]
    journal = Journal(run_dir, readonly=True)
    ended = {a["attempt"]: a["ended"] for a in journal.attempts()}
    journal.close()
    assert all(e["t"] < ended[e["attempt"]] - 0.2 for e in missed)  # said while the attempt ran, not after
    warnings = [r for r in received if r["event"] == "warning"]
    assert [w["message"] for w in warnings] == [said.removeprefix("[oomguard] ")]  # notified once
    assert [w["message"] for w in status(run_dir)["warnings"]] == [said.removeprefix("[oomguard] ")] * 2
    doc = report(run_dir)
    assert [f["steps_lost"] for f in doc["failures"]] == really_redone(run_dir) == [7, 7]
    assert doc["steps_lost"] == 14
    assert all(f["resumed_from"]["resumed"] is False for f in doc["failures"])


@pytest.mark.slow
def test_a_glob_that_matches_nothing_is_said_with_the_files_the_script_wrote(work: Path) -> None:
    """``checkpoints/*.pt`` while the script writes ``out/step-N.pt``: said once, with the glob to use."""
    out = run(work, "--micro-batch", "32", "--global-batch", "32", "--checkpoint", "checkpoints/*.pt",
              "--allow-smaller-global-batch",  # the script takes no accumulation (issue 20)
              "--resume-args", "--resume {checkpoint}", "--",
              PY, "train.py", "--batch-size", "{micro_batch}", "--budget-mb", "200", "--step-seconds", "0.4")
    assert out.returncode == 0, out.stderr[-3000:]
    said = re.findall(r"^\[oomguard\] (--checkpoint 'checkpoints/\*\.pt' matches nothing, .*)$", out.stderr, re.M)
    assert len(said) == 1, out.stderr
    assert "InotifyEmitter" not in out.stderr
    assert re.fullmatch(r"--checkpoint 'checkpoints/\*\.pt' matches nothing, but the script wrote out/step-\d+\.pt"
                        r"(, out/step-\d+\.pt)*( and \d+ more)?: a restart would start over; "
                        r"use --checkpoint 'out/step-\*\.pt'", said[0]), said[0]
    run_dir = work / "run"
    [event] = events(run_dir, "checkpoint_glob_unmatched")
    assert event["data"]["suggestion"] == "out/step-*.pt" and event["data"]["message"] == said[0]
    assert all(re.fullmatch(rf"{re.escape(str(work))}/out/step-\d+\.pt", f) for f in event["data"]["files"])
    assert [w["message"] for w in status(run_dir)["warnings"]] == said
    doc = report(run_dir)
    assert doc["checkpoints"]["count"] == 0
    assert [f["steps_lost"] for f in doc["failures"]] == really_redone(run_dir) == [7]


def start_run(work: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-m", "oomguard", "run", "--run-dir", str(work / "run"), *FAST, *args], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_while_running(done: Callable[[], bool], proc: subprocess.Popen[str], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline and proc.poll() is None, what
        time.sleep(0.1)


@pytest.mark.slow
def test_checkpoints_another_process_writes_under_the_directory_are_never_the_scripts(work: Path) -> None:
    """Issue 35: while the run goes, another shell copies a checkpoint to other_exp/best_model.pt, a
    package install writes a .pt under site-packages, another program holds its own .pt open for
    writing: none is named (following the old advice resumed another experiment's weights)."""
    proc = start_run(work, "--micro-batch", "32", "--grad-accum", "1", "--allow-smaller-global-batch",
                     "--checkpoint", "out/step-*.pt", "--resume-args", "--resume {checkpoint}", "--",
                     PY, "train.py", "--batch-size", "{micro_batch}", "--steps", "24", "--long-step", "1000",
                     "--step-seconds", "0.3")
    try:
        wait_while_running(lambda: (work / "out" / "step-2.pt").exists(), proc, "the script saved no checkpoint")
        site = "venv/lib/python3.11/site-packages/pkg"
        subprocess.run(["sh", "-c", f"mkdir -p other_exp {site} && cp out/step-2.pt other_exp/best_model.pt && "
                        f"cp out/step-2.pt {site}/weights.pt && cp out/step-2.pt best.pt"], cwd=work, check=True)
        subprocess.run([PY, "-c", "import time; f = open('other_exp/model_step_9.pt', 'wb'); f.write(b'x'); "
                        "f.flush(); time.sleep(1.5)"], cwd=work, check=True)  # written slowly, by another process
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "--checkpoint" not in stderr, stderr
    run_dir = work / "run"
    assert events(run_dir, "checkpoint_glob_unmatched") == []
    assert status(run_dir)["warnings"] == [] and report(run_dir)["warnings"] == []
    assert "warning" not in oomguard("ls", cwd=work).stdout


# Saves out/step-2.pt (the glob's), then at step 8 models/quick-8.pt in a blink (by path: the probe's record)
# or, with "slow", models/slow-8.pt held open for writing as a large checkpoint's write is (a file object).
OWN = """
import os, sys, time, torch
micro = int(os.environ["OOMGUARD_MICRO_BATCH"])
for step in range(1, 14):
    time.sleep(0.3)
    print(f"step {step}/13", flush=True)
    if step == 2:
        torch.save({"step": step}, "out/step-2.pt")
    if step == 8 and sys.argv[1] == "quick":
        torch.save({"step": step}, "models/quick-8.pt")
    if step == 8 and sys.argv[1] == "slow":
        with open("models/slow-8.pt", "wb") as f:
            torch.save({"step": step}, f)
            f.flush()
            time.sleep(1.5)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("options", "named"), [((), "models/quick-8.pt"), (("--no-probe",), "models/slow-8.pt")],
                         ids=["probe", "no-probe"])
def test_a_checkpoint_the_script_writes_is_named_by_its_save_record_or_its_open_file(
        tmp_path: Path, options: tuple[str, ...], named: str) -> None:
    """With the probe, its save record names the file the script wrote; without it, a file one of the
    worker's processes held open for writing as the write was reported (a large checkpoint's write;
    one written in a blink may go unseen, and is then not named). A copy another process makes
    there first is named in neither."""
    (tmp_path / "own.py").write_text(OWN)
    (tmp_path / "out").mkdir()
    (tmp_path / "models").mkdir()
    how = "quick" if named.endswith("quick-8.pt") else "slow"
    proc = start_run(tmp_path, *options, "--micro-batch", "8", "--grad-accum", "1", "--checkpoint", "out/step-*.pt",
                     "--resumes-itself", "--", PY, "own.py", how)
    try:
        wait_while_running(lambda: (tmp_path / "out" / "step-2.pt").exists(), proc, "the script saved no checkpoint")
        subprocess.run(["cp", "out/step-2.pt", "models/foreign-2.pt"], cwd=tmp_path, check=True)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    message = (f"--checkpoint 'out/step-*.pt' does not match {named}, which the script wrote and which looks like a "
               f"checkpoint: a restart would not resume from it; use --checkpoint 'models/{how}-*.pt'")
    assert re.findall(r"^\[oomguard\] (--checkpoint .*)$", stderr, re.M) == [message], stderr
    [event] = events(tmp_path / "run", "checkpoint_glob_unmatched")
    assert event["data"]["files"] == [str(tmp_path / named)]
    assert [w["message"] for w in status(tmp_path / "run")["warnings"]] == [message]


@pytest.mark.slow
def test_the_worker_library_form_starts_and_resumes_without_a_warning(work: Path) -> None:
    """docs/worker.md's form: --checkpoint and nothing else; the Session resumes from OOMGUARD_CHECKPOINT.
    A real allocator OOM at micro-batch 128 (the budget squeezed at step 9, in-process recovery off)."""
    out = run(work, "--global-batch", "128", "--micro-batch", "128", "--checkpoint", "ckpt/checkpoint-*", "--",
              PY, str(ROOT / "examples" / "train_worker_demo.py"), "--steps", "16", "--global-batch", "128",
              "--grow-after", "0", "--checkpoint-dir", "ckpt", "--checkpoint-every", "4", "--memory-budget-mb", "400",
              "--squeeze-budget-mb", "20", "--squeeze-at-step", "9", "--no-inprocess", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[oomguard] the script " not in out.stderr and "matches nothing" not in out.stderr, out.stderr
    run_dir = work / "run"
    doc = report(run_dir)
    assert [f["kind"] for f in doc["failures"]] == ["host_oom"]
    assert doc["failures"][0]["resumed_from"]["path"].endswith("checkpoint-8")  # a resume that was checked
    assert events(run_dir, "not_resumed") == [] and status(run_dir)["warnings"] == []


# --- a stop the user asked for is no failure -----------------------------------------------------------


STOPPABLE = '''
import os, signal, sys, time
from pathlib import Path

ck = Path(sys.argv[1])
step = int(os.environ.get("OOMGUARD_CHECKPOINT_STEP") or 0)
if len(sys.argv) > 2:  # a final checkpoint that takes its time
    signal.signal(signal.SIGTERM, lambda *_: time.sleep(120))
while step < 40:
    step += 1
    time.sleep(0.1)
    print(f"step {step}/40", flush=True)
    if step % 5 == 0:
        ck.mkdir(exist_ok=True)
        (ck / f"step-{step}").write_text(str(step))
print("finished", flush=True)
'''


def start(work: Path, *worker_args: str, grace: str = "5") -> subprocess.Popen[str]:
    (work / "stoppable.py").write_text(STOPPABLE)
    argv = [PY, "-m", "oomguard", "run", "--run-dir", str(work / "run"), *FAST, "--grace-period", grace,
            "--micro-batch", "8", "--grad-accum", "1", "--checkpoint", "ck/step-*",
            "--", PY, "stoppable.py", "ck", *worker_args]
    with open(work / "first-run.stderr", "w") as err:
        return subprocess.Popen(argv, cwd=work, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_for(predicate: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def reached(run_dir: Path, step: int) -> bool:
    log = run_dir / "logs" / "attempt-1.log"
    return log.exists() and any(s >= step for s in map(int, _STEP.findall(log.read_text())))


def test_ctrl_c_then_the_same_run_again_is_no_failure(work: Path) -> None:
    proc = start(work)
    run_dir = work / "run"
    wait_for(lambda: reached(run_dir, 12))
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 128 + signal.SIGINT
    stopped_at = time.time()
    time.sleep(1.0)  # the user comes back later
    # status says how to resume, and that line, run as printed from anywhere, resumes the run
    [resume] = [line for line in oomguard("status", "--run-dir", str(run_dir)).stdout.splitlines()
                if line.startswith("resume:")]
    again = subprocess.run(["bash", "-c", resume.removeprefix("resume:").strip()], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT),
                                            "PATH": f"{Path(PY).parent}:{os.environ['PATH']}"})
    assert again.returncode == 0, again.stderr
    doc = report(run_dir)
    # not a failure, but the steps the rerun did again after the stop are counted
    assert doc["failures"] == [] and doc["lost_s"] == 0 and doc["steps_lost"] == sum(really_redone(run_dir))
    assert [r["attempt"] for r in doc["restarts"]] == [1]
    assert [(s["attempt"], s["reason"]) for s in doc["stops"]] == [(1, "stopped by SIGINT: a stop asked for, not "
                                                                       "a failure")]
    assert doc["stops"][0]["at"] < stopped_at  # when it ended, not when the next run closed it
    assert status(run_dir)["failures"] == []
    text = oomguard("report", "--run-dir", str(run_dir)).stdout
    assert "failures:    none" in text and "stopped:     attempt 1 at " in text


def test_a_stop_the_next_supervisor_closes_is_no_failure(work: Path) -> None:
    """``oomguard stop``, and the supervisor is killed while the worker takes its time to stop: the next
    run closes the attempt as the user's stop, at its last activity."""
    proc = start(work, "slow-stop", grace="60")
    run_dir = work / "run"
    try:
        wait_for(lambda: reached(run_dir, 12))
        assert oomguard("stop", "--run-dir", str(run_dir)).returncode == 0
        wait_for(lambda: bool(events(run_dir, "stop_requested")))
        [asked] = events(run_dir, "stop_requested")
        time.sleep(0.5)
        proc.kill()  # a kill -9 while the worker stops: the attempt is left open
        proc.wait(timeout=30)
    finally:
        proc.kill()
    killed_at = time.time()
    time.sleep(1.0)
    again = oomguard("run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "8", "--grad-accum", "1",
                     "--checkpoint", "ck/step-*", "--", PY, "stoppable.py", "ck", cwd=work, timeout=60)
    assert again.returncode == 0, again.stderr
    assert "attempt 1 was interrupted by the end of its supervisor; closed as stopped by the user" in again.stderr
    doc = report(run_dir)
    assert doc["failures"] == [] and doc["lost_s"] == 0
    assert [(s["attempt"], s["reason"]) for s in doc["stops"]] == [(1, "stopped by SIGTERM: a stop asked for, not "
                                                                       "a failure")]
    assert asked["t"] <= doc["stops"][0]["at"] < killed_at  # its last activity, not the next run's start
    assert status(run_dir)["failures"] == []
