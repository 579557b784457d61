"""The demo as real processes: real host-memory OOMs under RLIMIT_AS, growing back, signals from
the supervisor, and a fatal CUDA error reported as a structured record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from workerkit import (
    ROOT,
    SMALL,
    Zygote,
    bitwise_equal,
    events,
    max_abs_diff,
    run_demo,
    samples_per_step,
    wait_for,
    weights,
)

# The demo at its own sizes (activations of ~0.15 MiB per sample), where 128 samples need more
# than 20 MiB of address space above start-up and 64 fit.
DEMO = ["--steps", "12", "--global-batch", "128", "--grow-after", "0"]
TIGHT_MB = "20"


def outputs(tmp: Path, name: str) -> tuple[list[str], dict[str, str]]:
    argv = ["--save-weights", str(tmp / f"{name}.pt"), "--log-samples", str(tmp / f"{name}.jsonl")]
    return argv, {"OOMGUARD_EVENTS": str(tmp / f"{name}.events")}


def ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_real_allocator_oom_is_absorbed_bit_for_bit(tmp_path: Path) -> None:
    """Under RLIMIT_AS the first step fails at 128 in PyTorch's allocator; the session retries it
    at 64 and the run is bit for bit the run that used 64 from the start (dropout included)."""
    argv, env = outputs(tmp_path, "tight")
    ok(run_demo([*DEMO, "--micro-batch", "128", "--memory-budget-mb", TIGHT_MB, *argv], env))
    ref_argv, ref_env = outputs(tmp_path, "ref64")
    ok(run_demo([*DEMO, "--micro-batch", "64", *ref_argv], ref_env))

    records = events(tmp_path / "tight.events")
    failure = next(r for r in records if r["type"] == "failure")
    assert failure["kind"] == "host_oom" and failure["micro_batch"] == 128 and failure["recovered"]
    assert "DefaultCPUAllocator: can't allocate memory" in failure["message"]
    assert [r["micro_batch"] for r in records if r["type"] == "batch"] == [64]
    assert [r["step"] for r in records if r["type"] == "progress"] == list(range(1, 13))
    assert bitwise_equal(weights(tmp_path / "tight.pt"), weights(tmp_path / "ref64.pt"))


def test_squeeze_mid_run_loses_no_step_and_matches_within_tolerance(tmp_path: Path) -> None:
    """Memory shrinks at step 6 (another tenant): step 6 OOMs at 128 and is redone at 64 in the
    same process; every step's samples are the same as without the squeeze, weights within 1e-5."""
    squeeze = ["--memory-budget-mb", "200", "--squeeze-at-step", "5", "--squeeze-budget-mb", TIGHT_MB]
    argv, env = outputs(tmp_path, "squeezed")
    ok(run_demo([*DEMO, "--micro-batch", "128", "--dropout", "0", *squeeze, *argv], env))
    ref_argv, ref_env = outputs(tmp_path, "ref128")
    ok(run_demo([*DEMO, "--micro-batch", "128", "--dropout", "0", *ref_argv], ref_env))

    records = events(tmp_path / "squeezed.events")
    failures = [r for r in records if r["type"] == "failure"]
    assert [(f["step"], f["micro_batch"]) for f in failures] == [(5, 128)]
    assert [r["step"] for r in records if r["type"] == "progress"] == list(range(1, 13))
    assert samples_per_step(tmp_path / "squeezed.jsonl") == samples_per_step(tmp_path / "ref128.jsonl")
    assert max_abs_diff(weights(tmp_path / "squeezed.pt"), weights(tmp_path / "ref128.pt")) < 1e-5


def test_grows_back_and_never_retries_a_failed_size(tmp_path: Path) -> None:
    argv, env = outputs(tmp_path, "grow")
    grow = ["--steps", "24", "--global-batch", "256", "--micro-batch", "16", "--grow-after", "2"]
    ok(run_demo([*grow, "--memory-budget-mb", "60", *argv], env))
    records = events(tmp_path / "grow.events")
    changes = [(r["micro_batch"], r["reason"]) for r in records if r["type"] == "batch"]
    assert changes[0] == (32, "grow"), changes
    assert max(size for size, _ in changes) >= 64
    failed = set()
    for record in records:
        if record["type"] == "failure":
            failed.add(record["micro_batch"])
        if record["type"] == "batch" and record["reason"] == "grow":
            assert record["micro_batch"] not in failed, f"retried a failed size: {changes}"
    assert [r["step"] for r in records if r["type"] == "progress"] == list(range(1, 25))


# An illegal access poisons the CUDA context; NCCL's out-of-memory is a memory failure (the supervisor
# halves for it) whose communicator is aborted, so a retry in the process would hang in the next collective.
FATAL = [("CUDA error: an illegal memory access was encountered", "cuda_fatal"),
         ("NCCL error: unhandled cuda error, NCCL version 2.19.3\\nLast error:\\nCuda failure 'out of memory'",
          "cuda_oom")]


@pytest.mark.parametrize(("message", "kind"), FATAL, ids=["illegal-access", "nccl-oom"])
def test_cuda_fatal_error_exits_with_a_structured_record(tmp_path: Path, message: str, kind: str) -> None:
    script = tmp_path / "fatal.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from oomguard import Session, SessionConfig

            def loss_fn(model, batch):
                if session.step_count == 2:  # what a poisoned CUDA context raises
                    raise RuntimeError("MESSAGE")
                return model(batch).pow(2).mean()

            model = torch.nn.Linear(4, 1)
            session = Session(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                              SessionConfig(global_batch=8))
            for _ in range(5):
                session.step(torch.randn(8, 4))
            """
        ).replace("MESSAGE", message)
    )
    env = {**os.environ, "OOMGUARD_EVENTS": str(tmp_path / "events.jsonl")}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert message.split("\\n")[-1] in proc.stderr
    failure = next(r for r in events(tmp_path / "events.jsonl") if r["type"] == "failure")
    assert failure["kind"] == kind and failure["step"] == 2


LONG = [*SMALL, "--steps", "100000", "--global-batch", "32", "--micro-batch", "8"]


def progressed(path: Path, step: int) -> bool:
    return any(r["type"] == "progress" and r["step"] >= step for r in events(path))


def test_sigterm_checkpoints_at_the_step_boundary_and_exits_143(zygote: Zygote, tmp_path: Path) -> None:
    ckpt, ev = tmp_path / "ckpt", tmp_path / "events.jsonl"
    argv = [*LONG, "--checkpoint-dir", str(ckpt)]
    pid = zygote.spawn(argv, tmp_path / "log.txt", {"OOMGUARD_EVENTS": str(ev)})
    assert wait_for(lambda: progressed(ev, 20), timeout=30)
    os.kill(pid, signal.SIGTERM)
    assert zygote.wait(pid) == 128 + signal.SIGTERM
    saved = [r for r in events(ev) if r["type"] == "checkpoint"]
    last = max(r["step"] for r in events(ev) if r["type"] == "progress")
    assert [r["step"] for r in saved] == [last], "one checkpoint, of the last completed step"
    assert (
        Path(saved[0]["path"]).name == f"checkpoint-{last}" and (Path(saved[0]["path"]) / "COMPLETE").exists()
    )

    # The restart continues from there with nothing lost.
    resumed = [*SMALL, "--steps", str(last + 3), "--global-batch", "32", "--checkpoint-dir", str(ckpt)]
    assert zygote.run(resumed, tmp_path / "log.txt", {"OOMGUARD_EVENTS": str(ev)}) == 0
    after = [r for r in events(ev) if r["type"] == "progress" and r["step"] > last]
    assert [r["step"] for r in after] == [last + 1, last + 2, last + 3]
    assert after[0]["micro_batch"] == 8, "the tuned micro-batch comes back from the checkpoint"


def test_checkpoint_on_request_file_and_signal(zygote: Zygote, tmp_path: Path) -> None:
    ckpt, ev, request = tmp_path / "ckpt", tmp_path / "events.jsonl", tmp_path / "checkpoint.request"
    env: dict[str, Any] = {
        "OOMGUARD_EVENTS": str(ev),
        "OOMGUARD_CHECKPOINT_REQUEST": str(request),
        "OOMGUARD_CHECKPOINT_SIGNAL": "SIGUSR1",
    }
    pid = zygote.spawn([*LONG, "--checkpoint-dir", str(ckpt)], tmp_path / "log.txt", env)
    assert wait_for(lambda: progressed(ev, 5), timeout=30)
    request.touch()
    os.kill(pid, signal.SIGUSR1)
    assert wait_for(lambda: not request.exists(), timeout=10), "the request file was not removed"
    saved = [r for r in events(ev) if r["type"] == "checkpoint"]
    assert len(saved) == 1 and (Path(saved[0]["path"]) / "COMPLETE").exists()
    assert saved[0]["step"] >= 5
    os.kill(pid, signal.SIGTERM)
    assert zygote.wait(pid) == 128 + signal.SIGTERM


def test_runs_without_any_supervisor_variable(tmp_path: Path) -> None:
    proc = run_demo(["--steps", "3", "--global-batch", "64", "--micro-batch", "32"])
    ok(proc)
    assert "done: 3 steps" in proc.stderr
    assert ROOT.exists()
