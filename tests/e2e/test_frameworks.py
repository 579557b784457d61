"""Real frameworks on their defaults, end to end, silent for longer than --hang-timeout: a LightningCLI
script that prints nothing itself (Lightning's Rich bar draws nothing into a pipe until the end) and a
Hugging Face Trainer with ``disable_tqdm``, a large ``logging_steps`` and ``save_total_limit=2``. Each
hits a real allocator OOM (RLIMIT_AS) after a checkpoint exists; neither is ever killed as hung,
each resumes from the framework's own newest checkpoint, status ends at the last step, and the
report counts as lost only the time after the checkpoint the next attempt resumed from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, oomguard, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
EXAMPLES = ROOT / "examples"
FAST = ["--no-web", "--backoff", "0.05", "--max-backoff", "0.2"]
HANG = ["--hang-timeout", "2", "--sample-interval", "0.5"]  # far shorter than their silent stretches


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), *FAST, *HANG, *args, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def journal_of(tmp_path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(events, checkpoint writes as first seen)."""
    journal = Journal(tmp_path / "run", readonly=True)
    try:
        return journal.events(limit=100_000), journal.checkpoint_writes()
    finally:
        journal.close()


def check_run(tmp_path: Path, resumed_name: str, resumed_step: int, last_step: int) -> dict[str, Any]:
    """One host OOM, no hang; resumed from ``resumed_name``; status at ``last_step``; lost time from
    that checkpoint's first write."""
    doc = status(tmp_path / "run")
    assert doc["state"] == "succeeded", doc["reason"]
    assert [(f["kind"], f["micro_batch"]) for f in doc["failures"]] == [("host_oom", 16)]
    assert doc["micro_batch"] == 8 and doc["grad_accum"] == 4  # the global batch kept
    assert doc["progress"]["step"] == last_step
    events, writes = journal_of(tmp_path)
    held = [e["data"] for e in events if e["kind"] == "held_alive"]
    assert held and all(h["busy"].endswith("% of a core") for h in held)  # silent past 2 s, and busy
    assert not [e for e in events if e["kind"] == "hang"]
    out = oomguard("report", "--run-dir", str(tmp_path / "run"), "--json")
    (failure,) = json.loads(out.stdout)["failures"]
    assert failure["resumed_from"]["path"].endswith(resumed_name) and failure["resumed_from"]["step"] == resumed_step
    assert failure["steps_lost"] == 0 or failure["last_step_source"] == "checkpoint"
    first_write = min(w["mtime"] for w in writes if w["path"] == failure["resumed_from"]["path"])
    assert failure["lost_s"] == pytest.approx(failure["ended"] - first_write, abs=0.01)
    assert failure["lost_s"] < failure["ended"] - failure["started"] - 1.0  # not the whole attempt
    return failure


@pytest.mark.slow
def test_lightning_cli_silent_rich_bar_is_not_a_hang(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("rich")  # Lightning's default bar is then the Rich one: nothing drawn into a pipe
    run(tmp_path, "--micro-batch", "16", "--global-batch", "32",
        "--checkpoint", "lightning_logs/version_*/checkpoints/*.ckpt", "--resume-args", "--ckpt_path {checkpoint}",
        "--",
        PY, str(EXAMPLES / "train_lightning_cli.py"), "fit", "--data.batch_size", "{micro_batch}",
        "--trainer.accumulate_grad_batches", "{grad_accum}", "--model.memory_budget_mb", "16",
        "--trainer.max_epochs", "3")
    # 128 samples at 32 a step: 4 optimizer steps an epoch, 12 in all; the OOM came in epoch 1
    check_run(tmp_path, "/epoch=0-step=4.ckpt", 4, 12)
    assert (tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "epoch=2-step=12.ckpt").exists()


@pytest.mark.slow
def test_hf_trainer_silent_with_rotation_is_not_a_hang(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run(tmp_path, "--micro-batch", "16", "--global-batch", "32", "--checkpoint", "out/checkpoint-*",
        "--resume-args", "--resume_from_checkpoint {checkpoint}", "--",
        PY, str(EXAMPLES / "train_hf_trainer.py"), "--per_device_train_batch_size", "{micro_batch}",
        "--gradient_accumulation_steps", "{grad_accum}", "--output_dir", "out", "--memory-budget-mb", "300",
        "--budget-from-step", "4", "--max_steps", "8", "--save_steps", "2", "--save_total_limit", "2",
        "--logging_steps", "1000", "--disable_tqdm", "--quiet")
    # rotation deleted checkpoint-4, which the first attempt wrote and the second resumed from: it
    # still counts for the first attempt
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    check_run(tmp_path, "/checkpoint-4", 4, 8)
