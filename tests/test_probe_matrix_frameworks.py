"""The probe is invisible to the frameworks' own compile switches (issue 35): Lightning with a module
compiled in ``configure_model``, HF Trainer's ``torch_compile=True``, ``accelerate launch
--dynamo_backend inductor`` and nanoGPT's default ``compile = True``. Each case is the repo's example
run twice from the same seed, without the probe and with it loaded as the supervisor loads it
(``runtime.with_probe``), both through tests/workers/matrix_record.py, and the two must match: every
loss bit for bit (CPU, one thread: each framework here is deterministic), the weights after every
optimizer step, dynamo's counters and the frames it compiled and recompiled. The probed run must
have loaded the probe, with no failure, and counted the framework's own optimizer steps. One case
also goes through a real ``oomguard run`` on its defaults: one attempt, the same steps as directly.

The inductor cache is shared by the whole session (``TORCHINDUCTOR_CACHE_DIR``): a case's second run
compiles the same graphs from it, which dynamo's own counters do not see (inductor's cache hits and
misses are left out of the comparison, and nothing else of theirs is compared).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from probing import last_step, probe_env, records
from support import ROOT, oomguard, status

PY = sys.executable
EXAMPLES = ROOT / "examples"
RECORD = Path(__file__).resolve().parent / "workers" / "matrix_record.py"
# Dynamo's own sections: how many frames it saw and compiled, the graphs, the graph breaks, the resume
# functions after them. The caches' sections (aot_autograd, inductor) say hit in the run after a miss.
DYNAMO_SECTIONS = ("frames", "stats", "graph_break", "resumes")
NANOGPT_ARGS = ["--max_iters=4", "--eval_interval=2"]
NANOGPT_STEPS = 5  # iterations 0-4, one AdamW step each


@dataclass
class Process:
    """What one training process recorded at its exit (matrix_record.py)."""

    rank: str | None
    losses: list[float]
    steps: list[dict[str, Any]]
    counters: dict[str, dict[str, int]]
    compiles: list[dict[str, Any]]

    def dynamo(self) -> dict[str, dict[str, int]]:
        # A section no one counted in is absent, or empty where something only looked (a cold cache's).
        return {section: self.counters.get(section) or {} for section in DYNAMO_SECTIONS}

    def frames(self) -> list[dict[str, Any]]:
        """The frames dynamo compiled, each with its ops and the guard that failed for a recompile. Not
        the metrics of a compile that is no frame's (``None None``: a backward compiled on a cold cache)."""
        return [c for c in self.compiles if c["code"] != "None None"]

    def recompiles(self) -> list[str]:
        return [c["recompile_reason"] for c in self.frames() if c["recompile_reason"] is not None]


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One inductor cache for the session (the one in the environment, if any): a graph compiled once."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(tmp_path_factory.mktemp("inductor-cache"))


def train(tmp: Path, argv: list[str], cache: str, probe: bool, **extra: str) -> dict[int, Process]:
    """One run of ``argv`` (which starts matrix_record.py) in ``tmp``: its processes by pid."""
    tmp.mkdir()
    common = {"MATRIX_RECORD": str(tmp / "record"), "TORCHINDUCTOR_CACHE_DIR": cache, **extra}
    if probe:
        env = probe_env(tmp, **common)
    else:
        env = {k: v for k, v in probe_env(tmp, **common).items() if k != "OOMGUARD_EVENTS"}
        env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    found = {}
    for path in (tmp / "record").glob("*.json"):
        doc = json.loads(path.read_text())
        found[doc["pid"]] = Process(doc["rank"], doc["losses"], doc["steps"], doc["counters"], doc["compiles"])
    assert found, out.stdout[-3000:] + out.stderr[-3000:]
    return found


def trained(processes: dict[int, Process]) -> dict[str | None, Process]:
    """The processes that trained (stepped an optimizer), by rank: a compile worker never does."""
    return {p.rank: p for p in processes.values() if p.steps}


def assert_invisible(tmp: Path, argv: list[str], cache: str, **extra: str) -> tuple[dict[int, Process], Process]:
    """Run ``argv`` without and with the probe; every trained process the same in both. Returns the
    probed run's processes (by pid) and its rank-0 (or only) trainer."""
    plain = trained(train(tmp / "plain", argv, cache, probe=False, **extra))
    probed_all = train(tmp / "probed", argv, cache, probe=True, **extra)
    probed = trained(probed_all)
    assert plain.keys() == probed.keys()
    for rank, without in plain.items():
        with_probe = probed[rank]
        assert with_probe.losses == without.losses, rank  # exact floats: the same bits
        assert [s["params"] for s in with_probe.steps] == [s["params"] for s in without.steps], rank
        assert with_probe.dynamo() == without.dynamo(), rank
        assert with_probe.frames() == without.frames(), rank  # the same frames, ops and recompiles
        assert with_probe.counters["stats"]["unique_graphs"] >= 1  # it compiled: the case tests what it says
    failed = [r for r in records(tmp / "probed", "probe") if r["state"] == "failed"]
    assert not failed, failed
    return probed_all, probed.get("0", probed.get(None, next(iter(probed.values()))))


def optimizer_steps(process: Process, optimizer: str = "AdamW") -> int:
    return sum(1 for s in process.steps if s["optimizer"] == optimizer)


def probe_counted(tmp: Path, processes: dict[int, Process], steps: int) -> None:
    """The probe loaded in each trained process and counted its optimizer steps."""
    for pid, process in processes.items():
        if not process.steps:
            continue
        states = [r["state"] for r in records(tmp / "probed", "probe") if r["pid"] == pid]
        # loaded once; what it left out where the program compiles is said once, never a failure
        assert states.count("loaded") == 1 and "failed" not in states and len(states) <= 2, states
        assert last_step(tmp / "probed", pid) == steps == optimizer_steps(process)


@pytest.mark.slow
def test_nanogpt_default_compile(tmp_path: Path, inductor_cache: str) -> None:
    """nanoGPT's form with its default ``compile = True``: ``torch.compile(model)``, saves of the
    compiled module's state to ``out/ckpt.pt``."""
    argv = [PY, str(RECORD), str(EXAMPLES / "train_nanogpt_style.py"), *NANOGPT_ARGS]
    processes, main = assert_invisible(tmp_path, argv, inductor_cache)
    probe_counted(tmp_path, processes, NANOGPT_STEPS)
    assert not main.recompiles() and main.counters["stats"]["unique_graphs"] == 1
    saves = records(tmp_path / "probed", "save")
    assert [s["step"] for s in saves] == [2, 4]  # ckpt.pt at iterations 2 and 4, after 2 and 4 steps


@pytest.mark.slow
def test_nanogpt_default_compile_under_oomguard_run(tmp_path: Path, inductor_cache: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The same script under ``oomguard run`` on its defaults (probe and spare on): one attempt, no
    failure, the steps the direct run counts (NANOGPT_STEPS), the probe loaded."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)  # the worker inherits it
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), "--no-web", "--micro-batch", "8", "--global-batch", "32",
                   "--checkpoint", "out/ckpt.pt", "--resume-args", "--init_from=resume", "--",
                   PY, str(EXAMPLES / "train_nanogpt_style.py"), "--batch_size={micro_batch}",
                   "--gradient_accumulation_steps={grad_accum}", *NANOGPT_ARGS, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = status(tmp_path / "run")
    assert doc["state"] == "succeeded" and doc["attempt"] == 1 and doc["failures"] == [], doc
    assert doc["progress"]["step"] == NANOGPT_STEPS
    assert doc["probe"]["state"] == "loaded" and doc["probe"]["failures"] == []
    assert f"iter {NANOGPT_STEPS - 1}: loss" in out.stdout


@pytest.mark.slow
def test_hf_trainer_torch_compile(tmp_path: Path, inductor_cache: str) -> None:
    """``TrainingArguments(torch_compile=True)``: the Trainer has accelerate compile the model; GPT-2's
    forward breaks its graph at a logging call, so dynamo resumes after it."""
    pytest.importorskip("transformers")
    argv = [PY, str(RECORD), str(EXAMPLES / "train_hf_trainer.py"), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--max_steps", "4", "--save_steps", "2", "--seq-len", "16",
            "--vocab", "256", "--disable_tqdm", "--quiet", "--torch_compile"]
    processes, main = assert_invisible(tmp_path, argv, inductor_cache)
    probe_counted(tmp_path, processes, 4)  # the Trainer's global_step
    assert len(main.losses) == 8  # two micro-batches a step
    saved = sorted(p.name for p in (tmp_path / "probed" / "out").glob("checkpoint-*"))
    assert saved == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.slow
def test_lightning_module_compiled_in_configure_model(tmp_path: Path, inductor_cache: str) -> None:
    pytest.importorskip("lightning")
    argv = [PY, str(RECORD), str(EXAMPLES / "train_lightning_cli.py"), "fit", "--data.batch_size", "16",
            "--data.samples", "64", "--data.tokens", "8", "--data.features", "32", "--model.features", "32",
            "--model.hidden", "64", "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
            "--model.compile", "true"]
    processes, main = assert_invisible(tmp_path, argv, inductor_cache)
    probe_counted(tmp_path, processes, 4)  # 64 samples at 16 a step
    assert not main.recompiles()
    checkpoints = tmp_path / "probed" / "lightning_logs" / "version_0" / "checkpoints"
    assert [p.name for p in checkpoints.glob("*.ckpt")] == ["epoch=0-step=4.ckpt"]


@pytest.mark.slow
def test_accelerate_launch_dynamo_backend(tmp_path: Path, inductor_cache: str) -> None:
    """``accelerate launch --dynamo_backend inductor``: ``prepare`` compiles the model. The third step's
    longer sequences fail a shape guard: one recompile (dynamic), the same with the probe as without."""
    pytest.importorskip("accelerate")
    argv = [str(Path(PY).parent / "accelerate"), "launch", "--num_processes", "1", "--cpu",
            "--dynamo_backend", "inductor", str(RECORD), str(EXAMPLES / "train_accelerate.py"), "--batch_size", "4",
            "--gradient_accumulation_steps", "2", "--steps", "4", "--long_every", "3", "--long_seq", "48"]
    processes, main = assert_invisible(tmp_path, argv, inductor_cache)
    probe_counted(tmp_path, processes, 4)
    (reason,) = main.recompiles()
    assert "size mismatch" in reason, reason
