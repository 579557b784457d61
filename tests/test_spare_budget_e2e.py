"""A LightningCLI run in a job's memory cgroup that fits with a few hundred MB to spare, not with
spares beside it (issue 35: the kernel's OOM killer ended the worker at step 2): under oomguard's
defaults it reaches the step ``--no-spare`` reaches, and status says why no spare was started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, status

PY = sys.executable
MIB = 1 << 20
SPARE_ROOM = 300 * MIB  # above the measured peak: room for the run, not for a spare (~376 MB) and its margin
COMMAND = [PY, str(ROOT / "examples" / "train_lightning_cli.py"), "fit", "--data.batch_size", "{micro_batch}",
           "--trainer.accumulate_grad_batches", "{grad_accum}", "--trainer.max_epochs", "2"]


def run_in(cgroup: Path, tmp: Path, *options: str) -> subprocess.CompletedProcess[str]:
    cmd = [PY, "-m", "oomguard", "run", "--run-dir", str(tmp / "run"), "--no-web", "--micro-batch", "16",
           "--global-batch", "32", "--checkpoint", "lightning_logs/version_*/checkpoints/*.ckpt",
           "--resume-args", "--ckpt_path {checkpoint}", *options, "--", *COMMAND]
    joined = " ".join(f"'{a}'" for a in cmd)
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {joined}"], capture_output=True,
                          text=True, timeout=120, cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT)})


def peak(cgroup: Path) -> int:
    """The cgroup's highest usage (v1 memory.max_usage_in_bytes, v2 memory.peak)."""
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        if (cgroup / name).exists():
            return int((cgroup / name).read_text())
    pytest.skip("this kernel keeps no peak for a memory cgroup")


def finished(tmp: Path, out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = status(tmp / "run")
    assert doc["state"] == "succeeded" and doc["failures"] == []
    return doc


@pytest.mark.slow
def test_lightning_cli_in_a_tight_cgroup_reaches_the_step_it_reaches_without_spares(
        tmp_path: Path, memory_cgroup: Any) -> None:
    pytest.importorskip("lightning")
    roomy = memory_cgroup(4 << 30, "oomguard-sparebudget")
    alone = finished(tmp_path / "alone", run_in(roomy, tmp_path / "alone", "--no-spare"))
    tight = memory_cgroup(peak(roomy) + SPARE_ROOM, "oomguard-sparebudget")
    doc = finished(tmp_path / "spares", run_in(tight, tmp_path / "spares"))
    assert doc["progress"]["step"] == alone["progress"]["step"] == 8  # two epochs of four steps
    assert (tmp_path / "spares" / "lightning_logs" / "version_0" / "checkpoints" / "epoch=1-step=8.ckpt").exists()
    assert doc["spare"]["state"] == "not started"
    assert doc["spare"]["why"].startswith(("the cgroup limit", "the worker's peak is not known yet"))
    text = subprocess.run([PY, "-m", "oomguard", "status", "--run-dir", str(tmp_path / "spares" / "run")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert f"spare:      not started: {doc['spare']['why']}" in text
