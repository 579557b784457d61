"""The probe is invisible to the frameworks' own compile switches (issue 35): nanoGPT's default
``compile = True``, HF Trainer's ``torch_compile=True``, Lightning with a module compiled in
``configure_model``, ``accelerate launch --dynamo_backend inductor``. Each case is the repo's example,
unmodified, run from the same seed without the probe and with it loaded as the supervisor loads it
(tests/probing_matrix.py), through tests/matrix/framework_run.py, which records every loss handed
to ``backward``, the weights after every optimizer step and the frames dynamo compiled. The two runs
must match: the losses and weights bit for bit (CPU, one thread: each of these frameworks is
deterministic there), dynamo's counters, its frames with their ops and recompiles, the warnings. The
probed run must have loaded the probe and counted the framework's own optimizer steps. The nanoGPT
case also goes through a real ``oomguard run`` on its defaults: one attempt, the steps it takes directly.

Inductor compiles in the training process here (``TORCHINDUCTOR_COMPILE_THREADS=1``): its pool of
compile workers, each a Python that imports torch (and gets the probe), costs a 2-core CI box more
than the compile; the ``oomguard run`` case keeps the pool, as a user's run has it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from probing_matrix import INDUCTOR_CACHE, MATRIX_DIR, Run, assert_invisible, run_pair
from support import ROOT, oomguard, status

EXAMPLES = ROOT / "examples"
RUN = str(MATRIX_DIR / "framework_run.py")
NANOGPT_ARGS = ["--max_iters=4", "--eval_interval=2"]
NANOGPT_STEPS = 5  # iterations 0-4, one AdamW step each
TIMEOUT = 600  # a cold inductor cache on a loaded 2-core box: a minute or two per compiled model
IN_PROCESS = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


def frameworks_pair(tmp: Path, argv: list[str]) -> tuple[Run, Run]:
    """``argv`` (after the interpreter) without and with the probe: the same in every respect compared."""
    plain, probed = run_pair(tmp, argv, timeout=TIMEOUT, **IN_PROCESS)
    assert_invisible(plain, probed)
    assert probed.extra["steps"] == plain.extra["steps"]  # each step's optimizer and weights, bitwise
    assert probed.extra["frames"] == plain.extra["frames"]  # the frames compiled, their ops, each recompile's guard
    assert plain.counters["stats"]["unique_graphs"] >= 1  # it compiled: the case tests what it says
    return plain, probed


def counted(probed: Run, steps: int) -> None:
    """The probe loaded, said once what it leaves out in a process that compiles, and counted the
    framework's optimizer steps: one process, one step per optimizer step of the model's AdamW."""
    assert [r["state"] for r in probed.records if r["type"] == "probe"] == ["loaded", "partial"]
    assert probed.steps() == steps == sum(1 for s in probed.extra["steps"] if s["optimizer"] == "AdamW")


def recompiles(run: Run) -> list[str]:
    return [f["recompile_reason"] for f in run.extra["frames"] if f["recompile_reason"] is not None]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)  # two fresh torch processes, the first maybe on a cold inductor cache
def test_nanogpt_default_compile(tmp_path: Path) -> None:
    """nanoGPT's form on its default ``compile = True``: ``torch.compile(model)`` before training, the
    compiled module's state saved to ``out/ckpt.pt`` at each evaluation."""
    plain, probed = frameworks_pair(tmp_path, [RUN, str(EXAMPLES / "train_nanogpt_style.py"), *NANOGPT_ARGS])
    counted(probed, NANOGPT_STEPS)
    assert not recompiles(plain) and plain.counters["stats"]["unique_graphs"] == 1
    saves = [r for r in probed.records if r["type"] == "save"]
    assert [s["step"] for s in saves] == [2, 4]  # ckpt.pt at iterations 2 and 4, after 2 and 4 steps


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)  # two fresh torch processes, the first maybe on a cold inductor cache
def test_nanogpt_default_compile_under_oomguard_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same script under ``oomguard run`` on its defaults (probe and spare on): one attempt, no
    failure, the steps it takes directly (NANOGPT_STEPS), the probe loaded."""
    INDUCTOR_CACHE.mkdir(exist_ok=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE))  # the worker inherits it
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), "--no-web", "--micro-batch", "8", "--global-batch", "32",
                   "--checkpoint", "out/ckpt.pt", "--resume-args", "--init_from=resume", "--",
                   sys.executable, str(EXAMPLES / "train_nanogpt_style.py"), "--batch_size={micro_batch}",
                   "--gradient_accumulation_steps={grad_accum}", *NANOGPT_ARGS, cwd=tmp_path, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = status(tmp_path / "run")
    assert doc["state"] == "succeeded" and doc["attempt"] == 1 and doc["failures"] == [], doc
    assert doc["progress"]["step"] == NANOGPT_STEPS and doc["newest_checkpoint"]["step"] == 4
    assert doc["probe"]["state"] == "loaded" and doc["probe"]["failures"] == [], doc["probe"]
    assert "no forward figures" in doc["probe"]["partial"][0]["detail"]  # said once: it compiled before its first step
    assert doc["progress"]["source"] == "probe"
    assert f"iter {NANOGPT_STEPS - 1}: loss" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)  # two fresh torch processes, the first maybe on a cold inductor cache
def test_hf_trainer_torch_compile(tmp_path: Path) -> None:
    """``TrainingArguments(torch_compile=True)``: the Trainer has accelerate compile the model; GPT-2's
    forward breaks its graph at a logging call, and dynamo resumes after it (the same breaks both ways)."""
    pytest.importorskip("transformers")
    plain, probed = frameworks_pair(tmp_path, [
        RUN, str(EXAMPLES / "train_hf_trainer.py"), "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "2", "--max_steps", "4", "--save_steps", "2", "--seq-len", "16",
        "--vocab", "256", "--disable_tqdm", "--quiet", "--torch_compile"])
    counted(probed, 4)  # the Trainer's global_step
    assert len(plain.losses) == 8  # two micro-batches a step
    saved = sorted(p.name for p in (tmp_path / "probed" / "out").glob("checkpoint-*"))
    assert saved == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)  # two fresh torch processes, the first maybe on a cold inductor cache
def test_lightning_module_compiled_in_configure_model(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    plain, probed = frameworks_pair(tmp_path, [
        RUN, str(EXAMPLES / "train_lightning_cli.py"), "fit", "--data.batch_size", "16", "--data.samples", "64",
        "--data.tokens", "8", "--data.features", "32", "--model.features", "32", "--model.hidden", "64",
        "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false", "--model.compile", "true"])
    counted(probed, 4)  # 64 samples at 16 a step
    assert not recompiles(plain)
    checkpoints = tmp_path / "probed" / "lightning_logs" / "version_0" / "checkpoints"
    assert [p.name for p in checkpoints.glob("*.ckpt")] == ["epoch=0-step=4.ckpt"]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)  # two fresh torch processes, the first maybe on a cold inductor cache
def test_accelerate_launch_dynamo_backend(tmp_path: Path) -> None:
    """``accelerate launch --dynamo_backend inductor``: ``prepare`` compiles the model. The third step's
    longer sequences fail a shape guard: one recompile (dynamic), the same with the probe as without."""
    pytest.importorskip("accelerate")
    plain, probed = frameworks_pair(tmp_path, [
        "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu", "--dynamo_backend", "inductor",
        RUN, str(EXAMPLES / "train_accelerate.py"), "--batch_size", "4", "--gradient_accumulation_steps", "2",
        "--steps", "4", "--long_every", "3", "--long_seq", "48"])
    counted(probed, 4)
    (reason,) = recompiles(plain)
    assert "size mismatch" in reason, reason
