"""Every step oomguard reports after a resume is the script's own step.

examples/train_argparse.py mapped its allocator's pools before setting its memory budget with a
full training step, ``opt.step()`` included, on every start: the optimizer stepped once more than
the script per start, and oomguard, which counts optimizer steps (Adam's restored ``state["step"]``,
or ``OOMGUARD_CHECKPOINT_STEP`` for SGD), reported ``checkpoint-12 (step 14)`` and ``step 14/12``
after two restarts. The warm-up now takes no optimizer step: the script's count, the optimizer's and
oomguard's agree, with a resume in between, for an optimizer that keeps a count and for one that does not.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import ROOT, oomguard, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
SCRIPT = str(ROOT / "examples" / "train_argparse.py")
# No spare interpreters: this file checks no spare, and each spare imports torch again beside the worker
# (spares have their own tests: test_spare*.py, test_ownfault.py, the frameworks' and probe matrices' default runs).
FAST = ["--no-web", "--no-spare", "--backoff", "0.05", "--max-backoff", "0.2"]


def held_step(checkpoint: Path) -> int:
    """The step a checkpoint holds, by the script's own record."""
    step = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    assert isinstance(step, int)
    return step


def adam_steps(checkpoint: Path) -> set[int]:
    """The optimizer steps AdamW's state in the checkpoint counts (one per parameter, all equal)."""
    state = torch.load(checkpoint / "state.pt")["optimizer"]["state"]
    return {int(s["step"]) for s in state.values()}


def script(out: Path, *args: str) -> str:
    done = subprocess.run([PY, SCRIPT, "--output", str(out), "--memory-budget-mb", "100", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_warm_up_before_the_memory_budget_takes_no_optimizer_step(tmp_path: Path) -> None:
    """The root cause, without oomguard: the optimizer's count is the script's step, before and
    after a resume, and a resumed run trains the same model as one that never stopped."""
    script(tmp_path / "a", "--steps", "2", "--batch-size", "8")
    assert adam_steps(tmp_path / "a" / "checkpoint-2") == {2}
    script(tmp_path / "a", "--steps", "4", "--batch-size", "8", "--resume-from", str(tmp_path / "a" / "checkpoint-2"))
    assert adam_steps(tmp_path / "a" / "checkpoint-4") == {4} and held_step(tmp_path / "a" / "checkpoint-4") == 4
    script(tmp_path / "b", "--steps", "4", "--batch-size", "8")
    resumed, straight = (torch.load(tmp_path / d / "checkpoint-4" / "state.pt")["model"] for d in ("a", "b"))
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_resumed_run_reports_the_scripts_own_steps(tmp_path: Path, optimizer: str) -> None:
    """Two real host OOMs at step 5 (a long batch), resumed twice from checkpoint-4, done at 8 × 8:
    the journal, status and report say the steps the script printed and its checkpoints hold."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    done = oomguard("run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "32", "--global-batch", "64",
                    "--checkpoint", f"{out}/checkpoint-*", "--resume-args", "--resume-from {checkpoint}", "--",
                    PY, SCRIPT, "--batch-size", "{micro_batch}", "--gradient-accumulation-steps", "{grad_accum}",
                    "--output", str(out), "--memory-budget-mb", "100", "--steps", "8", "--optimizer", optimizer,
                    timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [int(n) for n in re.findall(r"^step (\d+)/8 ", done.stdout, re.M)]
    assert max(printed) == 8 and done.stdout.count(f"resumed from {out}/checkpoint-4 at step 4") == 2
    doc = status(run_dir)
    assert [f["kind"] for f in doc["failures"]] == ["host_oom", "host_oom"]
    assert (doc["progress"]["step"], doc["progress"]["total_steps"]) == (8, 8)
    journal = Journal(run_dir, readonly=True)
    checkpoints = journal.checkpoints()
    assert {c["step"] for c in checkpoints} == {2, 4, 6, 8}
    for c in checkpoints:  # each one's step is what it holds, by the script's record and the optimizer's
        assert c["step"] == held_step(Path(c["path"])), c
        assert optimizer == "sgd" or adam_steps(Path(c["path"])) == {c["step"]}, c
    events = journal.events()
    assert [e["data"]["step"] for e in events if e["kind"] == "resume_point"] == [4, 4]
    # The step records journaled (each attempt's first, then at most one every few seconds) are steps the
    # script printed; the last attempt's first is 5, one past the step it resumed at.
    steps = [(e["attempt"], e["data"]["step"]) for e in events if e["kind"] == "worker_step"]
    assert {s for _, s in steps} <= set(printed) and [s for a, s in steps if a == 3][:1] == [5], steps
    assert journal.attempts()[-1]["last_step"] == 8
    text = oomguard("report", "--run-dir", str(run_dir)).stdout
    assert f"newest {out}/checkpoint-8 (step 8)" in text and "last progress: step 8/8," in text, text
    assert "last step 4, resumed from step 4 " in text, text
