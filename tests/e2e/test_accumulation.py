"""The accumulation as the script takes it, end to end, each with a real allocator OOM (RLIMIT_AS):

- a script that takes only a micro-batch (examples/train_argparse.py given ``--batch-size`` alone):
  said at start; its OOM is refused a halving (exit 1, naming --allow-smaller-global-batch); run again
  with that option, it is halved and every record shows the global batch it really trains at;
- nanoGPT's form under torchrun (examples/train_nanogpt_style.py divides its
  ``--gradient_accumulation_steps`` by WORLD_SIZE, as nanoGPT's train.py does): given
  ``{grad_accum_total}``, it trains at the global batch oomguard keeps, before and after a halving.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from support import ROOT, oomguard, status

from oomguard.supervisor.record.journal import Journal
from oomguard.web.metrics import make_registry

PY = sys.executable
EXAMPLES = ROOT / "examples"
# No spare interpreters: this file checks no spare, and each spare imports torch again beside the worker
# (spares have their own tests: test_spare*.py, test_ownfault.py, the frameworks' and probe matrices' default runs).
FAST = ["--no-web", "--no-spare", "--backoff", "0.05"]


def test_a_script_without_accumulation_is_refused_a_halving_then_shrunk_honestly(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    args = ["--micro-batch", "32", "--global-batch", "32", "--checkpoint", "out/checkpoint-*",
            "--resume-args", "--resume-from {checkpoint}", "--", PY, str(EXAMPLES / "train_argparse.py"),
            "--batch-size", "{micro_batch}", "--output", "out", "--steps", "6", "--memory-budget-mb", "130"]
    refused = oomguard("run", "--run-dir", run, *FAST, *args, cwd=tmp_path, timeout=150)
    assert refused.returncode == 1, refused.stderr[-3000:]
    lines = refused.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("[oomguard] the command passes {micro_batch} but "
                                                                 "no {grad_accum}: the script cannot accumulate")]
    started = [i for i, line in enumerate(lines) if line.startswith("[oomguard] starting:")]
    assert len(said) == 1 and said[0] < started[0] and "a halving will shrink it" in lines[said[0]]  # at start
    doc = status(tmp_path / "run")
    assert doc["state"] == "failed" and "pass --allow-smaller-global-batch" in doc["reason"]
    assert [(f["kind"], f["micro_batch"]) for f in doc["failures"]] == [("host_oom", 32)]
    assert (doc["global_batch"], doc["asked_global_batch"]) == (32, 32)

    # The same run, allowed: it continues from its checkpoint at half the micro-batch, and says so.
    shrunk = oomguard("run", "--run-dir", run, *FAST, "--allow-smaller-global-batch", *args, cwd=tmp_path,
                      timeout=150)
    assert shrunk.returncode == 0, shrunk.stderr[-3000:]
    assert "micro-batch 16 x accumulation 1 = 16" in shrunk.stdout  # the script's own words
    assert "attempt 3: micro-batch 16 × accumulation 1 × world 1 = 16 (asked 32)" in shrunk.stderr
    doc = status(tmp_path / "run")
    assert doc["state"] == "succeeded" and (doc["micro_batch"], doc["grad_accum"]) == (16, 1)
    assert (doc["global_batch"], doc["asked_global_batch"], doc["accumulates"]) == (16, 32, False)
    text = oomguard("status", "--run-dir", run).stdout
    assert "batch:      micro 16 × accum 1 × world 1 = 16 (asked 32)" in text
    report = oomguard("report", "--run-dir", run).stdout
    assert "attempt 3: micro 16 × accum 1 × world 1 = 16 (asked 32)" in report
    journal = Journal(tmp_path / "run", readonly=True)
    assert [(a["micro_batch"], a["grad_accum"], a["global_batch"]) for a in journal.attempts()] == [
        (32, 1, 32), (32, 1, 32), (16, 1, 16)]
    metrics = generate_latest(make_registry(lambda: journal)).decode()
    assert "oomguard_global_batch 16.0" in metrics and "oomguard_asked_global_batch 32.0" in metrics


@pytest.mark.slow
def test_nanogpt_under_torchrun_takes_the_total_accumulation(tmp_path: Path) -> None:
    """docs/forms.md's form: 32 = 16 × 1 × 2, so nanoGPT is given 2 and divides it by its 2 ranks."""
    torchrun = str(Path(PY).parent / "torchrun")
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), *FAST, "--micro-batch", "16", "--global-batch", "32",
                   "--checkpoint", "out/ckpt.pt", "--resume-args", "--init_from=resume", "--",
                   torchrun, "--standalone", "--nproc_per_node=2", str(EXAMPLES / "train_nanogpt_style.py"),
                   "--batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum_total}",
                   "--memory_budget_mb=85", "--max_iters=6", "--compile=False",  # eager, as its budget was measured
                   cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "divides" not in out.stderr  # the start check is satisfied by {grad_accum_total}
    doc = status(tmp_path / "run")
    assert [(f["kind"], f["micro_batch"]) for f in doc["failures"]] == [("host_oom", 16)]
    assert (doc["micro_batch"], doc["grad_accum"], doc["world_size"], doc["global_batch"]) == (8, 2, 2, 32)
    # nanoGPT's own count, after dividing by WORLD_SIZE: 32 samples of 128 tokens, before and after
    assert re.findall(r"tokens per iteration will be: ([\d,]+)", out.stdout) == ["4,096", "4,096"]
    commands = [a["command"] for a in Journal(tmp_path / "run", readonly=True).attempts()]
    assert ["--gradient_accumulation_steps=2" in c for c in commands] == [True, False]
    assert ["--gradient_accumulation_steps=4" in c for c in commands] == [False, True]
