"""Runs in a job's memory cgroup sized from their own measured ``--no-spare`` peak, which fit
alone and not with spares beside them (issue 35: the kernel's OOM killer ended the worker): a
LightningCLI run with a few hundred MB to spare reaches the step ``--no-spare`` reaches, and a
plain script 8 MiB under the limit (killed by the kernel on the old rules, in 2 runs of 2) finishes;
status says why no spare was started."""

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
    assert f"spares:     not started: {doc['spare']['why']}" in text


GROW = """import sys, time
held = []
for _ in range(int(sys.argv[1]) // 4):
    block = bytearray(4 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    held.append(block)
    time.sleep(0.02)  # slower than a spare's start: on the old rules the spares are there at the peak
print("done", flush=True)
"""


def run_plain(cgroup: Path, tmp: Path, script: Path, *options: str) -> subprocess.CompletedProcess[str]:
    cmd = [PY, "-m", "oomguard", "run", "--run-dir", str(tmp / "run"), "--no-web", "--no-probe", "--backoff", "0.05",
           "--max-restarts", "0", "--micro-batch", "1", "--global-batch", "1", *options,
           "--", PY, str(script), "400", "{micro_batch}"]
    joined = " ".join(f"'{a}'" for a in cmd)
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {joined}"], capture_output=True,
                          text=True, timeout=60, cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_worker_that_fits_its_jobs_limit_by_less_than_the_spares_take_is_not_killed_for_them(
        tmp_path: Path, memory_cgroup: Any) -> None:
    """A plain script growing to 400 MiB in a job's cgroup 8 MiB above its --no-spare peak: two
    spares (launcher and interpreter, ~20 MiB each) do not fit beside it. On the old rules both
    started, the limit was reached, and the kernel took the worker (oom_score_adj 500, larger than
    a small spare by over half the limit) before the spares (1000): ``host_oom``, killed by the
    kernel OOM killer, in 2 runs of 2."""
    script = tmp_path / "grow.py"
    script.write_text(GROW)
    roomy = memory_cgroup(2 << 30, "oomguard-sparebudget")
    finished(tmp_path / "alone", run_plain(roomy, tmp_path / "alone", script, "--no-spare"))
    tight = memory_cgroup(peak(roomy) + 8 * MIB, "oomguard-sparebudget")
    doc = finished(tmp_path / "spares", run_plain(tight, tmp_path / "spares", script))
    assert doc["spare"]["state"] == "not started"
