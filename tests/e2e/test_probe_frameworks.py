"""The probe in the frameworks' own loops, unmodified examples started as the supervisor starts
them: the step it counts is the framework's own last optimizer step (HF Trainer with and without
gradient accumulation, LightningCLI, ``accelerate launch`` with two CPU processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from probing import last_step, records, run_probed
from support import ROOT

PY = sys.executable
EXAMPLES = ROOT / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 3])
def test_hf_trainer_steps_are_its_global_steps(tmp_path: Path, accum: int) -> None:
    pytest.importorskip("transformers")
    run_probed(tmp_path, [PY, str(EXAMPLES / "train_hf_trainer.py"), "--per_device_train_batch_size", "2",
                          "--gradient_accumulation_steps", str(accum), "--max_steps", "5", "--save_steps", "100",
                          "--seq-len", "16", "--vocab", "256", "--disable_tqdm", "--quiet"])
    assert last_step(tmp_path) == 5  # Trainer's global_step: one optimizer step per `accum` micro-batches
    assert sum(r["steps"] for r in records(tmp_path, "step")) == 5
    assert [r["state"] for r in records(tmp_path, "probe")] == ["loaded"]


@pytest.mark.slow
def test_lightning_cli_steps_are_its_global_steps(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    run_probed(tmp_path, [PY, str(EXAMPLES / "train_lightning_cli.py"), "fit", "--data.batch_size", "16",
                          "--trainer.accumulate_grad_batches", "2", "--trainer.max_epochs", "1",
                          "--trainer.enable_progress_bar", "false"])
    # 128 samples at 16 × 2 a step: 4 optimizer steps, as its checkpoint's name says
    assert last_step(tmp_path) == 4
    assert [p.name for p in tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")] == ["epoch=0-step=4.ckpt"]


@pytest.mark.slow
def test_accelerate_launch_two_processes_each_count_their_steps(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    out = run_probed(tmp_path, [str(Path(PY).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                                str(EXAMPLES / "train_accelerate.py"), "--batch_size", "4",
                                "--gradient_accumulation_steps", "2", "--steps", "4", "--long_seq", "32"],
                     ACCELERATE_USE_CPU="1")
    assert "saved out/step_4" in out.stdout
    loaded = records(tmp_path, "probe")
    assert sorted((r["state"], r["rank"], r["local_rank"], r["world_size"]) for r in loaded) == [
        ("loaded", 0, 0, 2), ("loaded", 1, 1, 2)]
    for record in loaded:  # accelerate's wrapper and the AdamW inside it: one step each iteration
        assert last_step(tmp_path, record["pid"]) == 4
