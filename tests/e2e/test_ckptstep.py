"""A checkpoint's step end to end (tests/workers/bs_named.py): a script that names its checkpoints
``ckpt_step{N}_bs{B}.pt`` is halved from micro-batch 32 to 8, and each restart resumes from the
highest step, not from the highest last number (the batch size, which the halving made smaller);
one that names them by micro-batches gets the probe's count of optimizer steps."""

from __future__ import annotations

import sys
from pathlib import Path

from support import WORKERS, oomguard, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
BS_NAMED = str(WORKERS / "bs_named.py")
# No spare interpreters: this file checks no spare, and each spare imports torch again beside the worker
# (spares have their own tests: test_spare*.py, test_ownfault.py, the frameworks' and probe matrices' default runs).
FAST = ["--no-web", "--no-spare", "--backoff", "0.05", "--max-backoff", "0.2"]


def test_a_restart_resumes_from_the_highest_step_not_the_batch_size_in_the_name(run_dir: Path,
                                                                               tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    out = oomguard("run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "32", "--global-batch", "32",
                   "--checkpoint", f"{ck}/ckpt_*.pt", "--resume-args", "--resume-from {checkpoint}",
                   "--", PY, BS_NAMED, "--ckpt-dir", str(ck), timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Attempt 3 (micro-batch 8) has ckpt_step100_bs32.pt and ckpt_step200_bs16.pt to choose from:
    # the last number in the name would pick the first, 100 steps of work lost.
    assert "resumed from ckpt_step100_bs32.pt step 100" in out.stdout
    assert "resumed from ckpt_step200_bs16.pt step 200" in out.stdout, out.stdout
    assert "saved step 300 at micro-batch 8" in out.stdout
    doc = status(run_dir)
    assert doc["state"] == "succeeded" and doc["micro_batch"] == 8
    journal = Journal(run_dir, readonly=True)
    assert [a["checkpoint"] for a in journal.attempts()] == [
        None, str(ck / "ckpt_step100_bs32.pt"), str(ck / "ckpt_step200_bs16.pt")]
    steps = {Path(c["path"]).name: c["step"] for c in journal.checkpoints()}
    assert steps == {"ckpt_step100_bs32.pt": 100, "ckpt_step200_bs16.pt": 200, "ckpt_step300_bs8.pt": 300}
    resumed = [(e["data"]["step"], e["data"]["step_from"]) for e in journal.events() if e["kind"] == "resume_point"]
    assert resumed == [(100, "save"), (200, "save")]
    # Each step is the probe's count at the save, which agrees with the name here.
    seen = {Path(e["data"]["path"]).name: e["data"] for e in journal.events() if e["kind"] == "checkpoint"}
    assert {name: (d["step"], d["step_from"]) for name, d in seen.items()} == {
        "ckpt_step100_bs32.pt": (100, "save"), "ckpt_step200_bs16.pt": (200, "save"),
        "ckpt_step300_bs8.pt": (300, "save")}


def test_the_probes_count_beats_a_name_that_counts_micro_batches(run_dir: Path, tmp_path: Path) -> None:
    """accelerate's examples name ``step_{overall_step}``, micro-batches: at accumulation 2 the
    script's step_200.pt holds optimizer step 100. Taken from the name, ``{checkpoint_step}`` would
    say 200 and the resume check would call the resume at step 101 a failure to resume."""
    ck = tmp_path / "ck"
    out = oomguard("run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "32", "--global-batch", "64",
                   "--checkpoint", f"{ck}/step_*.pt", "--resume-args", "--resume-from {checkpoint}",
                   "--", PY, BS_NAMED, "--ckpt-dir", str(ck), "--name", "batches", "--fail-above", "16",
                   timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step_200.pt step 100" in out.stdout
    journal = Journal(run_dir, readonly=True)
    steps = {Path(c["path"]).name: c["step"] for c in journal.checkpoints()}
    assert steps == {"step_200.pt": 100, "step_600.pt": 200}  # 100 more steps, 400 micro-batches at accumulation 4
    resumed = [(e["data"]["step"], e["data"]["step_from"]) for e in journal.events() if e["kind"] == "resume_point"]
    assert resumed == [(100, "save")]
    assert status(run_dir)["warnings"] == []  # resumed where it was told: no not_resumed
