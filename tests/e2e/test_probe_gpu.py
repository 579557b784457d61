"""The probe on a real GPU (issue 27 part 4): real CUDA OOMs in the caching allocator, the figures the
probe's OOM observer reports, and the cause lines built from them. Run on a machine with a GPU:

    OOMGUARD_GPU_TESTS=1 .venv/bin/pytest -q tests/e2e/test_probe_gpu.py

Everywhere else every test here skips and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, WORKERS, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
WORKER = str(WORKERS / "gpu_batch.py")

pytestmark = pytest.mark.skipif(not os.environ.get("OOMGUARD_GPU_TESTS"),
                                reason="set OOMGUARD_GPU_TESTS=1 on a CUDA machine")


@pytest.fixture(autouse=True)
def _cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def run(run_dir: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--backoff", "0.1",
                           "--sample-interval", "0.2", *argv], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def oom_records(run_dir: Path) -> list[dict[str, Any]]:
    return [e["data"] for e in Journal(run_dir, readonly=True).events(limit=100000) if e["kind"] == "worker_oom"]


def test_nanogpt_style_from_512_each_oom_in_the_allocators_words(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = run(run_dir, tmp_path, "--micro-batch", "512", "--global-batch", "512", "--checkpoint", "out/rank0/ckpt.pt",
              "--resume-args", "--init_from=resume", "--",
              PY, WORKER, "--batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum}")
    assert out.returncode == 0, out.stderr
    doc = status(run_dir)
    assert doc["state"] == "succeeded" and doc["micro_batch"] < 512
    assert doc["micro_batch"] * doc["grad_accum"] == 512  # the global batch kept
    failures = [f for f in doc["failures"] if f["kind"] == "cuda_oom"]
    assert failures, doc["failures"]
    for failure in failures:
        summary = failure["cause"]["summary"]
        # the allocator's figures
        assert "allocated; the limit was" in summary and "needed at least" in summary, summary
        assert "does not follow" not in summary and "grew as the micro-batch shrank" not in summary, summary
    records = oom_records(run_dir)
    assert len(records) >= len(failures)
    for record in records:
        assert record["device"].startswith("cuda:") and record["requested_bytes"] > 0
        assert 0 < record["allocated_bytes"] <= record["total_bytes"]
    assert doc["probe"]["state"] == "loaded"


def test_two_ranks_under_a_memory_fraction_see_the_fraction_as_the_limit(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = run(run_dir, tmp_path, "--micro-batch", "512", "--global-batch", "1024", "--checkpoint",
              "out/rank0/ckpt.pt", "--resume-args", "--init_from=resume", "--",
              "torchrun", "--standalone", "--nproc_per_node=2", WORKER, "--fraction=0.3",
              "--batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum}")
    assert out.returncode == 0, out.stderr
    records = oom_records(run_dir)
    assert records, out.stderr
    for record in records:
        assert record["fraction"] == pytest.approx(0.3)
    import torch

    cap = 0.3 * torch.cuda.get_device_properties(0).total_memory
    doc = status(run_dir)
    for failure in (f for f in doc["failures"] if f["kind"] == "cuda_oom"):
        summary = failure["cause"]["summary"]
        assert "30% of the device" in summary and "does not follow" not in summary, summary
        assert "0 MiB, " not in summary, summary  # no trend of zero taken for a reading
    limit = (doc.get("progress") or {}).get("limit_bytes")  # the probe's last step record: the fraction's cap
    assert limit is None or abs(limit - cap) < 0.01 * cap
