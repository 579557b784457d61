"""The wrapping forms of docs/forms.md (and README's CPU recovery) for real scripts, end to end: each
example hits a real allocator OOM (RLIMIT_AS, so PyTorch's CPU allocator fails with
``DefaultCPUAllocator: can't allocate memory``) after a checkpoint exists, and oomguard resumes it at
half the micro-batch with the same global batch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, oomguard, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
EXAMPLES = ROOT / "examples"
FAST = ["--no-web", "--backoff", "0.05", "--max-backoff", "0.2"]


def run(tmp_path: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), *FAST, *args, cwd=tmp_path, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # The forms are wired right: every resume is verified and no warning is said.
    assert "[oomguard] the script " not in out.stderr and "matches nothing" not in out.stderr, out.stderr
    assert status(tmp_path / "run")["warnings"] == []
    return out


def report(tmp_path: Path) -> dict:  # type: ignore[type-arg]
    out = oomguard("report", "--run-dir", str(tmp_path / "run"), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check_recovered(tmp_path: Path, global_batch: int, floor: int = 8) -> dict:  # type: ignore[type-arg]
    """Recovered from a real allocator OOM at micro-batch 16 at half (``floor`` allows one more halving
    where the script's address-space budget is close to what a smaller batch needs)."""
    doc = status(tmp_path / "run")
    assert doc["state"] == "succeeded" and doc["global_batch"] == global_batch
    assert floor <= doc["micro_batch"] <= 8 and doc["micro_batch"] * doc["grad_accum"] == global_batch, doc["failures"]
    sizes = [16 >> i for i in range(len(doc["failures"]))]
    assert [(f["kind"], f["micro_batch"]) for f in doc["failures"]] == [("host_oom", m) for m in sizes]
    assert all("DefaultCPUAllocator: can't allocate memory" in f["evidence"] for f in doc["failures"])
    return doc


def test_nanogpt_form_steps_redone_from_the_output(tmp_path: Path) -> None:
    out = run(tmp_path, "--micro-batch", "16", "--global-batch", "32", "--checkpoint", "out/ckpt.pt",
              "--resume-args", "--init_from=resume", "--",
              PY, str(EXAMPLES / "train_nanogpt_style.py"), "--batch_size={micro_batch}",
              "--gradient_accumulation_steps={grad_accum}", "--memory_budget_mb=85",
              "--compile=False")  # eager: the budget is measured so; compiled, it is test_probe_matrix_frameworks's
    assert "Resuming training from out" in out.stdout and "iter 8:" in out.stdout
    # A checkpoint saved under the budget leaves the address space larger; the example fixes glibc's mmap
    # threshold against that, and micro-batch 4 is still accepted as a recovery with the batch kept.
    doc = check_recovered(tmp_path, 32, floor=4)
    # ckpt.pt has no step in its name: it takes the step the probe counted at the torch.save that
    # wrote it (its mtime between the save's start and return), exactly 6 (iters 0-5 done), not the
    # last half-second step record before it (which said 1 for the save after three steps)
    assert doc["newest_checkpoint"]["step"] == 6
    failure = report(tmp_path)["failures"][0]
    # iter 4 was the last one printed: the probe counted five optimizer steps (iters 0-4); ckpt.pt was
    # written with iter_num 3 (three steps done) and the next attempt resumed there
    assert failure["last_step"] == 5 and failure["resumed_from"]["step"] == 3
    assert failure["steps_lost"] == 5 - failure["resumed_from"]["step"]
    # Both steps are the save records' own, though each save named the temp ckpt.pt.tmp it renamed
    # into place: not "output", the label of a step read from the output at the mtime.
    journal = Journal(tmp_path / "run", readonly=True)
    found = [(e["kind"], e["data"]["step"], e["data"]["step_from"]) for e in journal.events()
             if e["kind"] in ("checkpoint", "resume_point")]
    journal.close()
    assert found == [("checkpoint", 3, "save"), ("resume_point", 3, "save"), ("checkpoint", 6, "save")]


def test_nanochat_form_model_files_and_resume_from_step(tmp_path: Path) -> None:
    out = run(tmp_path, "--micro-batch", "16", "--global-batch", "32", "--checkpoint", "out/model_*.pt",
              "--resume-args", "--resume_from_step={checkpoint_step}", "--",
              PY, str(EXAMPLES / "train_nanochat_style.py"), "--device_batch_size={micro_batch}",
              "--total_batch_size=4096", "--checkpoint_dir=out", "--memory_budget_mb=75")
    assert "resumed from step 2" in out.stdout and "device batch 8, gradient accumulation steps 4" in out.stdout
    doc = check_recovered(tmp_path, 32)
    assert doc["newest_checkpoint"]["path"].endswith("model_000008.pt") and doc["newest_checkpoint"]["step"] == 8
    assert doc["progress"]["step"] == 8 and doc["progress"]["total_steps"] == 8
    failure = report(tmp_path)["failures"][0]
    assert failure["last_step"] == 2 and failure["resumed_from"]["step"] == 2 and failure["steps_lost"] == 0


def test_yaml_config_through_edit(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "tiny.yaml"
    shutil.copy(EXAMPLES / "configs" / "tiny.yaml", config)
    original = config.read_text()
    out = run(tmp_path, "--micro-batch", "16", "--global-batch", "32", "--checkpoint", "out/step_*.pt",
              "--resume-args", "--resume {checkpoint}",
              "--edit", "configs/tiny.yaml:train.micro_batch_size={micro_batch}",
              "--edit", "configs/tiny.yaml:train.gradient_accumulation_steps={grad_accum}", "--",
              PY, str(EXAMPLES / "train_yaml_config.py"), "--config", "configs/tiny.yaml", "--memory-budget-mb", "75")
    check_recovered(tmp_path, 32)
    copy = tmp_path / "run" / "edits" / "attempt-2" / "tiny.yaml"
    assert f"config {copy}: micro-batch 8 x accumulation 4" in out.stdout
    assert f"resumed from {tmp_path}/out/step_2.pt at step 2" in out.stdout
    assert config.read_text() == original  # the user's file is never written
    edited = copy.read_text()
    assert "micro_batch_size: 8   # per process" in edited  # the comment keeps its column
    assert "# oomguard changes these keys" in edited


@pytest.mark.slow
def test_hf_trainer_form(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = run(tmp_path, "--micro-batch", "16", "--global-batch", "32", "--checkpoint", "out/checkpoint-*",
              "--resume-args", "--resume_from_checkpoint {checkpoint}", "--",
              PY, str(EXAMPLES / "train_hf_trainer.py"), "--per_device_train_batch_size", "{micro_batch}",
              "--gradient_accumulation_steps", "{grad_accum}", "--output_dir", "out", "--memory-budget-mb", "300",
              timeout=240)
    assert "micro-batch 8 x accumulation 4" in out.stdout and "finished at step 6" in out.stdout
    doc = check_recovered(tmp_path, 32)
    assert doc["newest_checkpoint"]["path"].endswith("checkpoint-6") and doc["newest_checkpoint"]["step"] == 6
    assert (tmp_path / "out" / "checkpoint-6" / "trainer_state.json").exists()
    failure = report(tmp_path)["failures"][0]
    assert failure["resumed_from"]["step"] == 2 and failure["steps_lost"] == 0


def readme_block(heading: str) -> str:
    """The first ``bash`` block under a README heading, as a user copies it."""
    section = (ROOT / "README.md").read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def test_readme_cpu_recovery_runs_as_written(tmp_path: Path) -> None:
    """The README's "Watch a real recovery without a GPU" block, run by bash as written from a checkout
    (examples/ and .venv linked into a fresh directory): two real allocator OOMs, then the run finishes
    at 8 × 8 = 64 and the report it prints says so."""
    venv = Path(PY).parent.parent
    if not (venv / "bin" / "activate").is_file() or not (venv / "bin" / "oomguard").is_file():
        pytest.skip(f"{PY} is not a virtual environment with oomguard installed, as set-up makes")
    (tmp_path / "examples").symlink_to(EXAMPLES)
    (tmp_path / ".venv").symlink_to(venv)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", readme_block("Watch a real recovery without a GPU")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = status(tmp_path / "runs" / "cpu")
    assert doc["state"] == "succeeded", doc
    assert [(f["kind"], f["micro_batch"]) for f in doc["failures"]] == [("host_oom", 32), ("host_oom", 16)]
    assert (doc["micro_batch"], doc["grad_accum"], doc["global_batch"]) == (8, 8, 64)
    assert all("DefaultCPUAllocator: can't allocate memory" in f["evidence"] for f in doc["failures"])
    assert "final state: succeeded" in out.stdout and "attempts:    3, failures: 2" in out.stdout, out.stdout
