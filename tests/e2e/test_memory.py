"""Memory watch end to end: a soft-threshold checkpoint request, and the memory model with --grow."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from support import WORKER, oomguard, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
FAST = ["--no-web", "--backoff", "0.05", "--max-backoff", "0.2", "--sample-interval", "0.2"]


def test_soft_threshold_asks_for_a_checkpoint_before_the_hard_limit(run_dir: Path) -> None:
    out = oomguard("run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "8", "--grad-accum", "1",
                   "--memory-limit", "200M", "--soft-threshold", "0.6", "--", PY, WORKER, "grow_rss",
                   "--mb-per-sample", "40", timeout=120)
    assert out.returncode == 0, out.stderr
    log = (run_dir / "logs" / "attempt-1.log").read_text()
    assert "checkpoint request received (signal 10, file True)" in log  # SIGUSR1 and the request file
    assert "held" not in log  # ... and then the hard limit ended it
    doc = status(run_dir)
    assert [f["kind"] for f in doc["failures"]] == ["memory_limit"]
    events = [e for e in Journal(run_dir, readonly=True).events() if e["kind"] == "checkpoint_request"]
    assert events and events[0]["attempt"] == 1 and events[0]["data"]["signal"] == "SIGUSR1"
    assert "soft" in events[0]["data"]["reason"] or "%" in events[0]["data"]["reason"]
    assert doc["micro_batch"] == 4 and doc["state"] == "succeeded"


def run_model(run_dir: Path, tmp_path: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    out = oomguard("run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "96", "--global-batch", "96",
                   "--memory-limit", "260M", "--checkpoint", f"{tmp_path}/ck/ck-*", "--resumes-itself", *extra, "--",
                   PY, WORKER, "model", "--mb-per-sample", "5", "--fixed-mb", "20", "--hold", "4",
                   "--ckpt-dir", str(tmp_path / "ck"), timeout=150)
    assert out.returncode == 0, out.stderr
    return status(run_dir)


def test_memory_model_with_grow_ends_at_the_largest_fitting_divisor(run_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-process batch 96, memory 30 MiB + 5 MiB/sample under a 260 MiB limit: up to ~44 fits.
    Halving alone stops at 24 after failing at 96 and 48; the model with --grow ends at 32
    (the largest divisor of 96 that fits) with no more failures."""
    halving = run_model(tmp_path / "halving", tmp_path / "h")
    assert [f["micro_batch"] for f in halving["failures"]] == [96, 48] and halving["micro_batch"] == 24
    # The same job (its checkpoint directory is where it writes, not what it is): a fit store of its
    # own, or it would start at the 24 the halving run fitted.
    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(tmp_path / "grown-cache"))
    grown = run_model(run_dir, tmp_path / "g", "--grow", "--grow-after", "1")
    assert [f["micro_batch"] for f in grown["failures"]] == [96, 48]
    assert grown["micro_batch"] == 32 and grown["grad_accum"] == 3 and grown["state"] == "succeeded"
    events = Journal(run_dir, readonly=True).events()
    planned = [e["data"] for e in events if e["kind"] == "grow_planned"]
    assert planned == [planned[0]] and planned[0]["micro_batch"] == 32 and planned[0]["predicted_bytes"]
    # A new run of the same job (same command) starts from what fitted, without re-discovering it.
    shutil.rmtree(tmp_path / "g" / "ck")
    again = run_model(tmp_path / "again", tmp_path / "g")
    assert again["failures"] == [] and again["micro_batch"] == 32
