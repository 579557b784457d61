"""``--predict-shrink`` in real processes: a prediction beyond proof after a first-step OOM, then ``--grow``.

The worker (tests/workers/frontloaded.py) caps its own address space (RLIMIT_AS) at what it maps
before training plus 26 MB, so micro-batch 8 fits and 16 fails in PyTorch's real ``DefaultCPUAllocator``
(glibc's mmap threshold is fixed, ``MALLOC_MMAP_THRESHOLD_``, so that freed tensors give their address
space back and a size that fits once keeps fitting: with the dynamic threshold the heap creeps).
Its forward spends most of its memory in its first layers: at micro-batch 64 the OOM comes a few
percent through the forward, and the probe's figures extrapolate a per-sample need far above the
real one. The same job is run twice from micro-batch 64 with the global batch 64:

- ``--grow`` alone halves: 64, 32 and 16 fail, three restarts before 8 runs (two where the OOM at 32
  proves 16 cannot fit);
- ``--grow --predict-shrink`` restarts once, straight at the predicted size (far below the halving's
  32), and ``--grow`` climbs back from there, never to a size that failed, the global batch kept.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, oomguard, status

from oomguard.supervisor.record.journal import Journal

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

SCRIPT = str(ROOT / "tests" / "workers" / "frontloaded.py")


def run(tmp_path: Path, name: str, *options: str, steps: int) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    ckpt = tmp_path / f"{name}-ckpt"
    out = oomguard("run", "--run-dir", str(tmp_path / name), "--no-web", "--no-spare", "--backoff", "0.05",
                   "--global-batch", "64", "--micro-batch", "64", "--checkpoint", str(ckpt / "checkpoint-*"),
                   "--resume-args", "--resume-from {checkpoint}", "--grow", "--grow-after", "2",
                   "--sample-interval", "0.2", *options, "--",
                   sys.executable, SCRIPT, "--batch-size", "{micro_batch}", "--gradient-accumulation-steps",
                   "{grad_accum}", "--steps", str(steps), "--pace", "0.05", "--output", str(ckpt),
                   timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    journal = Journal(tmp_path / name, readonly=True)
    try:
        changes = [e["data"] for e in journal.events() if e["kind"] == "plan_change"]
        attempts = journal.attempts()
    finally:
        journal.close()
    return status(tmp_path / name), changes, settled(attempts)


def settled(attempts: list[dict[str, Any]]) -> float:
    """Seconds from the first attempt's start to the start of the one that ran on at the final size."""
    return float(attempts[-1]["started"] - attempts[0]["started"])


@pytest.mark.timeout(600)  # several fresh torch processes; a loaded 2-core box is slow
def test_a_predicted_jump_saves_restarts_and_grow_climbs_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               fit_store_per_test: Path) -> None:
    monkeypatch.setenv("BUDGET_MB", "26")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    halved, halved_changes, halved_s = run(tmp_path, "halving", steps=2)
    # 16 fails too, unless the OOM at 32 asked enough to prove it cannot fit (memmodel.unfit): then it is skipped.
    assert [f["micro_batch"] for f in halved["failures"]] in ([64, 32, 16], [64, 32]), halved["failures"]
    assert halved["micro_batch"] == 8 and halved["global_batch"] == 64
    # A fresh fit store, or the second run would start where the first one settled.
    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(tmp_path / "cache-predicted"))

    # 12 steps: --grow (after 2 s at the jump's size) fired at the third step under a load of 10; once at 8
    # nothing grows further, and each step at global batch 64 costs a second: 40 steps trained 30 s for nothing.
    predicted, changes, predicted_s = run(tmp_path, "predicted", "--predict-shrink", steps=12)
    failed = [f["micro_batch"] for f in predicted["failures"]]
    assert failed[0] == 64 and all(f["kind"] == "host_oom" for f in predicted["failures"]), predicted["failures"]
    jump = next(c for c in changes if c["source"] == "decision")
    assert jump["from_micro_batch"] == 64 and jump["micro_batch"] < 16, jump  # halving would try 32
    assert "prediction beyond proof" in jump["reason"] and "the proven path would try 32" in jump["reason"]
    grows = [c for c in changes if c["source"] == "grow"]
    assert grows and grows[0]["micro_batch"] > jump["micro_batch"], changes  # --grow climbs back
    decisions = [c for c in changes if c["source"] == "decision"]
    assert all(c["micro_batch"] < min(failed[:k + 1]) for k, c in enumerate(decisions)), changes
    assert all(c["global_batch"] == 64 for c in changes) and predicted["global_batch"] == 64
    # Where it settled: above the jump, below every failure; 8 (the largest that fits) once --grow had
    # the steps to climb there (a loaded box may end the run on the way).
    assert jump["micro_batch"] < predicted["micro_batch"] <= 8, changes
    # Fewer memory failures than halving, and fewer restarts (attempts after the first) in all.
    assert len(failed) < len(halved["failures"])
    assert predicted["attempt"] < halved["attempt"], changes
    print(f"halving: {halved['attempt'] - 1} restarts ({len(halved['failures'])} OOMs) settled in {halved_s:.1f} s; "
          f"predicted: {predicted['attempt'] - 1} restarts ({len(failed)} OOMs, {len(grows)} grows) "
          f"settled in {predicted_s:.1f} s; plan changes {[(c['source'], c['micro_batch']) for c in changes]}")
