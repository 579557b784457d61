"""A job the fit store has measured starts at the largest size known to fit: 0 OOMs on the re-run.

The worker is the benchmark's plain script (bench/peerkit/train_plain.py), which caps its own
address space (RLIMIT_AS) at its first forward, so micro-batch 16 fails in PyTorch's real
``DefaultCPUAllocator`` and 8 fits. The second run has a new run directory and a new checkpoint
directory (the places a run writes name the run, not the job) and the same fit-store directory.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from support import ROOT, oomguard, status

from oomguard.supervisor.record.journal import Journal

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

PLAIN = str(ROOT / "bench" / "peerkit" / "train_plain.py")
# No spares: what the fit store decides does not depend on where a restart's interpreter came from, and each
# run's spare and reserve import torch beside the worker (two imports more a run, on a 2-core CI box: the
# first step came 13 to 16 s after the start with them under a load of 5). tests/e2e/test_spare*.py test spares.
NO_SPARE = "--no-spare"


def run(tmp_path: Path, name: str) -> dict[str, object]:
    ckpt = tmp_path / f"{name}-ckpt"
    out = oomguard("run", "--run-dir", str(tmp_path / name), "--no-web", NO_SPARE, "--backoff", "0.05",
                   "--global-batch", "16", "--micro-batch", "16", "--checkpoint", str(ckpt / "checkpoint-*"),
                   "--resume-args", "--resume-from {checkpoint}", "--",
                   sys.executable, PLAIN, "--batch-size", "{micro_batch}", "--gradient-accumulation-steps",
                   "{grad_accum}", "--steps", "2", "--output", str(ckpt), timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return status(tmp_path / name)


@pytest.mark.timeout(600)  # several fresh torch processes; a loaded 2-core box is slow
def test_a_measured_job_starts_where_it_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             fit_store_per_test: Path) -> None:
    # Large blocks always from mmap, freed to the system at once (a fixed threshold, as mallopt would set): glibc's
    # own threshold moves as blocks are freed, and a step then takes 103 to 136 MB at 16 samples and 67 to 70 at 8
    # (VmPeak less VmSize at the cap, measured here), so 100 MB sometimes fit 16. Fixed, 16 take 72.7 MB and 8
    # take 40 each time: 55 MB fails 16 and fits 8 by 15 MB or more.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    monkeypatch.setenv("PEERS_BUDGET_MB", "55")
    first = run(tmp_path, "first")
    assert [f["kind"] for f in first["failures"]] == ["host_oom"], first["failures"]
    assert "DefaultCPUAllocator" in first["failures"][0]["evidence"]
    assert first["micro_batch"] == 8 and first["global_batch"] == 16
    assert (fit_store_per_test / "fits.sqlite3").exists()

    again = run(tmp_path, "again")
    assert again["failures"] == [], again["failures"]
    assert (again["micro_batch"], again["grad_accum"], again["global_batch"]) == (8, 2, 16)


# A plain script that imports its model from a module the command does not name (nanoGPT's train.py and
# model.py): the benchmark's model and memory cap (workload.py, copied beside it), a step that takes a
# while as real ones do (so the supervisor reads the first step's records while the worker still runs).
TRAIN = """
import argparse
import time

import torch
import workload

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, required=True)
p.add_argument("--gradient-accumulation-steps", type=int, default=1)
p.add_argument("--steps", type=int, default=4)
args = p.parse_args()
workload.setup()
model = workload.TinyGPT()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
size = args.batch_size * args.gradient_accumulation_steps
for step in range(args.steps):
    opt.zero_grad(set_to_none=True)
    for chunk in workload.global_batch(step, size).split(args.batch_size):
        (model(chunk)["loss"] * (chunk.shape[0] / size)).backward()
    opt.step()
    print(f"step {step + 1}/{args.steps}", flush=True)
    time.sleep(0.25)
"""


def run_job(job: Path, run_dir: Path) -> tuple[dict[str, object], str]:
    """The run's status, and what the supervisor said."""
    out = oomguard("run", "--run-dir", str(run_dir), "--no-web", NO_SPARE, "--backoff", "0.05",
                   "--global-batch", "16", "--micro-batch", "16", "--",
                   sys.executable, "train.py", "--batch-size", "{micro_batch}", "--gradient-accumulation-steps",
                   "{grad_accum}", timeout=300, cwd=job)
    assert out.returncode == 0, out.stderr[-3000:]
    return status(run_dir), out.stdout + out.stderr


@pytest.mark.timeout(600)
def test_a_changed_model_in_an_imported_module_is_noticed_and_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fit_store_per_test: Path) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # as above: 55 MB fails 16, fits 8
    monkeypatch.setenv("PEERS_BUDGET_MB", "55")
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(TRAIN)
    workload = (ROOT / "bench" / "peerkit" / "workload.py").read_text()
    (job / "workload.py").write_text(workload)

    first, _ = run_job(job, tmp_path / "first")
    assert [f["kind"] for f in first["failures"]] == ["host_oom"], first["failures"]
    assert (first["micro_batch"], first["grad_accum"]) == (8, 2)
    models = Journal(tmp_path / "first", readonly=True).event_data("worker_model")
    assert models and all(m["optimizer"] == "AdamW" for m in models.values())

    same, said_same = run_job(job, tmp_path / "same")  # the same model: starts where it fits, nothing said
    assert same["failures"] == [] and (same["micro_batch"], same["grad_accum"]) == (8, 2)
    assert Journal(tmp_path / "same", readonly=True).event_data("model_changed") == {}
    assert "fitted micro-batch 8" in said_same and "model differs" not in said_same

    # The model changes in the imported module only (a shorter context: the position table and every
    # activation halve): the command and its files are the same, so the key is, and the record says 8.
    assert "    seq: int = 128\n" in workload
    (job / "workload.py").write_text(workload.replace("    seq: int = 128\n", "    seq: int = 64\n"))
    changed, said = run_job(job, tmp_path / "changed")
    journal = Journal(tmp_path / "changed", readonly=True)
    events = list(journal.event_data("model_changed").items())
    assert len(events) == 1 and said.count("the model differs from the one the fit store measured") == 1, said
    attempt, data = events[0]
    assert attempt == 1 and data["restart_at"] == 16
    assert data["measured_params"] - data["params"] == 64 * 128  # the position table's rows, both counts named
    # Restarted at once at the size asked for, which fits the shorter model: no OOM, the full micro-batch.
    assert changed["failures"] == [], changed["failures"]
    attempts = journal.attempts()
    assert [a["micro_batch"] for a in attempts] == [8, 16]
    assert (attempts[0]["ending"], attempts[0]["stop_reason"]) == ("grow", "model_changed")
    assert attempts[0]["decision"].startswith("model changed: micro-batch 8 -> 16"), attempts[0]["decision"]
    assert (changed["micro_batch"], changed["grad_accum"], changed["global_batch"]) == (16, 1, 16)

