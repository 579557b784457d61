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

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

PLAIN = str(ROOT / "bench" / "peerkit" / "train_plain.py")


def run(tmp_path: Path, name: str) -> dict[str, object]:
    ckpt = tmp_path / f"{name}-ckpt"
    out = oomguard("run", "--run-dir", str(tmp_path / name), "--no-web", "--backoff", "0.05",
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
