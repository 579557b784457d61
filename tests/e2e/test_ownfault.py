"""oomguard's own additions never fail a run (decide/classify.py), under the real ``oomguard run``: the
probe raising inside its hook, a spare failing at its handover. The run finishes, the batch is kept,
nothing is counted against the script, and console, journal, status and report say it once. A
program's own exception that only passes through our code is counted against the script as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from support import ROOT

from oomguard.supervisor.lifecycle import EXIT_GAVE_UP
from oomguard.supervisor.record.journal import Journal

PY = sys.executable
FAST = ["--no-web", "--backoff", "0", "--max-restarts", "1"]

TRAIN = """
import os, sys
import torch
micro, accum = int(sys.argv[2]), int(sys.argv[4])
print(f"attempt {os.environ['OOMGUARD_ATTEMPT']}: micro {micro} accum {accum}", flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 6):
    opt.zero_grad()
    for _ in range(accum):
        model(torch.randn(micro, 4)).sum().backward()
    opt.step()
print("trained", flush=True)
"""

# The test's own sitecustomize, which the probe's chains to (after the probe started, before torch is
# imported): it breaks the probe's forward tracker so that its post hook, in oomguard/probe/forward.py,
# raises into the program's first forward. Without the probe in the process it does nothing.
BREAK_THE_PROBE = """
try:
    from _oomguard_probe.probe import forward
except ImportError:
    forward = None
if forward is not None:
    original = forward.ForwardTracker.forget

    def forget(self):
        original(self)
        assert hasattr(self, "_learned"), "the probe's forward tracker changed: break it another way"
        self._learned = None  # the post hook's setdefault on it raises AttributeError in forward.py

    forward.ForwardTracker.forget = forget
"""


def supervise(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k == "OOMGUARD_CACHE_DIR" or not k.startswith("OOMGUARD_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{project}"  # the project's sitecustomize, as a user would put it
    return subprocess.run([PY, "-m", "oomguard", "run", "--run-dir", str(project / "run"), *FAST, *args],
                          cwd=project, env=env, text=True, capture_output=True, timeout=300)


def journal(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(attempts, events)."""
    j = Journal(run_dir, readonly=True)
    try:
        return j.attempts(), j.events()
    finally:
        j.close()


def cli(*args: str) -> str:
    out = subprocess.run([PY, "-m", "oomguard", *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_probe_raising_in_its_hook_turns_it_off_and_the_run_finishes(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "sitecustomize.py").write_text(BREAK_THE_PROBE)
    out = supervise(tmp_path, "--no-spare", "--micro-batch", "4", "--global-batch", "8", "--",
                    PY, "train.py", "--mb", "{micro_batch}", "--ga", "{grad_accum}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "run"
    log1 = (run_dir / "logs" / "attempt-1.log").read_text()
    assert "/probe/forward.py\", line" in log1 and "AttributeError" in log1  # it really died in our hook
    attempts, events = journal(run_dir)
    assert [(a["attempt"], a["kind"], a["micro_batch"], a["grad_accum"]) for a in attempts] == [
        (1, "crash", 4, 2), (2, None, 4, 2)]  # the batch is not to blame
    reason = attempts[0]["decision"]
    assert reason.startswith("oomguard's probe failed (oomguard/probe/forward.py, line ") and reason.endswith(
        ", in post); the next attempt runs without the probe"), reason
    own = [e for e in events if e["kind"] == "own_failure"]
    assert len(own) == 1 and own[0]["attempt"] == 1 and own[0]["data"]["addition"] == "probe"
    assert out.stderr.count("oomguard's probe failed") == 1 and "trained" in out.stdout
    assert not (run_dir / "logs" / "attempt-2.events.jsonl").exists()  # attempt 2 ran without the probe
    status = cli("status", "--run-dir", str(run_dir))
    assert status.count("oomguard's probe failed") == 1
    assert "probe:      none: turned off after attempt 1, which oomguard's probe failed (oomguard/probe/" in status
    report = cli("report", "--run-dir", str(run_dir))
    assert report.count("oomguard's probe failed") == 1 and f"done:     restart: {reason}" in report


# The script's own failure in attempt 1; attempt 2 is handed to a spare, whose handover the user's
# sitecustomize breaks in the spare alone (its os.chdir made a builtin that raises on a path): the
# exception leaves sparestart.py's own frame, as a bug of ours in the handover would.
APP = """
import os, sys
micro, accum = int(sys.argv[2]), int(sys.argv[4])
attempt = os.environ["OOMGUARD_ATTEMPT"]
print(f"attempt {attempt}: micro {micro} accum {accum}", flush=True)
if attempt == "1":
    sys.exit("the script's own failure, once")
print("trained", flush=True)
"""
BREAK_THE_HANDOVER = """
import os, sys
if any(arg.endswith("sparestart.py") for arg in sys.orig_argv):
    os.chdir = int
"""


def test_a_spare_failing_at_its_handover_turns_spares_off_and_the_run_finishes(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "sitecustomize.py").write_text(BREAK_THE_HANDOVER)
    # --max-restarts 1: the script's own crash in attempt 1 uses it up; the spare's failure must not count.
    out = supervise(tmp_path, "--micro-batch", "4", "--global-batch", "8", "--",
                    PY, "app.py", "--mb", "{micro_batch}", "--ga", "{grad_accum}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert "sparestart.py\", line" in (run_dir / "logs" / "attempt-2.log").read_text()  # it died in our handover
    attempts, events = journal(run_dir)
    assert [(a["attempt"], a["kind"], a["micro_batch"]) for a in attempts] == [
        (1, "crash", 4), (2, "crash", 4), (3, None, 4)]
    assert attempts[1]["decision"].startswith("oomguard's spare interpreter failed at its handover "
                                              "(oomguard/supervisor/run/sparestart.py, line ")
    own = [e for e in events if e["kind"] == "own_failure"]
    assert len(own) == 1 and own[0]["attempt"] == 2 and own[0]["data"]["addition"] == "spare"
    kinds = [(e["attempt"], e["kind"]) for e in events if e["kind"].startswith("spare_")]
    assert (2, "spare_used") in kinds and not [k for k in kinds if k[0] == 3]  # attempt 3 started cold, no spares
    assert out.stderr.count("oomguard's spare interpreter failed") == 1 and "trained" in out.stdout
    assert not list((run_dir / "spare").glob("ready-*.json"))
    status = cli("status", "--run-dir", str(run_dir))
    assert status.count("handover failed") == 1 and "spares:     off after attempt 2, whose handover failed" in status
    report = cli("report", "--run-dir", str(run_dir))
    assert report.count("oomguard's spare interpreter failed") == 1


# The program's own exception, raised inside the save our torch.save wrapper passes on, and the
# program's own excepthook (which ours chains to) failing as it is reported: both the script's.
THROUGH_OURS = """
import sys

def hook(kind, exc, tb):
    raise ValueError("the script's own excepthook fails")

sys.excepthook = hook  # before torch: the probe's excepthook chains to it
import torch

class Unsaveable:
    def __getstate__(self):
        raise RuntimeError("the script's own error")

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model(torch.randn(int(sys.argv[2]), 4)).sum().backward()
opt.step()
torch.save({"model": model.state_dict(), "extra": Unsaveable()}, "ckpt.pt")
"""


def test_the_scripts_own_exception_through_our_wrapper_and_excepthook_counts_against_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(THROUGH_OURS)
    out = supervise(tmp_path, "--no-spare", "--micro-batch", "4", "--global-batch", "4", "--",
                    PY, "train.py", "--mb", "{micro_batch}")
    assert out.returncode == EXIT_GAVE_UP, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "run"
    log1 = (run_dir / "logs" / "attempt-1.log").read_text()
    assert "/probe/steps.py\", line" in log1 and "/probe/oom.py\", line" in log1  # it passed through ours
    attempts, events = journal(run_dir)
    assert [(a["kind"], a["micro_batch"]) for a in attempts] == [("crash", 4), ("crash", 4)]
    assert "--max-restarts 1 is used up" in attempts[1]["decision"]
    assert not [e for e in events if e["kind"] == "own_failure"]
    assert (run_dir / "logs" / "attempt-2.events.jsonl").exists()  # the probe stayed in
