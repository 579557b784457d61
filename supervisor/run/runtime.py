"""What one attempt is started with: its argv (placeholders filled), environment and files."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.run.placeholders import render
from oomguard.worker import protocol


@dataclass(frozen=True)
class AttemptFiles:
    log: Path
    events: Path
    checkpoint_request: Path

    @staticmethod
    def of(run_dir: Path, attempt: int) -> AttemptFiles:
        return AttemptFiles(run_dir / "logs" / f"attempt-{attempt}.log",
                            run_dir / "logs" / f"attempt-{attempt}.events.jsonl",
                            run_dir / "checkpoint.request")


def placeholder_values(config: RunConfig, plan: Plan, attempt: int,
                       checkpoint: Checkpoint | None) -> dict[str, object]:
    batch = plan.batch
    return {
        "micro_batch": batch.micro_batch, "grad_accum": batch.grad_accum,
        "global_batch": batch.global_batch, "world_size": batch.world_size,
        "checkpoint": checkpoint.path if checkpoint else "",
        "checkpoint_step": checkpoint.step if checkpoint and checkpoint.step is not None else "",
        "attempt": attempt, "run_dir": str(config.run_dir.resolve()),
        "eval_micro_batch": plan.eval_micro_batch, "num_workers": plan.num_workers,
    }


def build_argv(config: RunConfig, plan: Plan, values: Mapping[str, object], has_checkpoint: bool) -> list[str]:
    """The command with placeholders filled, resume args (only with a checkpoint) and fallbacks."""
    argv = [render(token, values) for token in config.command]
    if has_checkpoint and config.resume_args:
        argv += [render(token, values) for token in shlex.split(config.resume_args)]
    for extra in config.fallback_args[:plan.fallbacks_applied]:
        argv += [render(token, values) for token in shlex.split(extra)]
    return argv


def with_expandable_segments(current: str | None) -> str:
    """PYTORCH_CUDA_ALLOC_CONF with expandable_segments:True, keeping the user's other settings."""
    parts = [p for p in (current or "").split(",") if p and not p.startswith("expandable_segments")]
    return ",".join([*parts, "expandable_segments:True"])


def build_env(config: RunConfig, plan: Plan, values: Mapping[str, object], files: AttemptFiles,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update({
        protocol.ENV_MICRO_BATCH: str(values["micro_batch"]),
        protocol.ENV_GRAD_ACCUM: str(values["grad_accum"]),
        protocol.ENV_GLOBAL_BATCH: str(values["global_batch"]),
        protocol.ENV_WORLD_SIZE: str(values["world_size"]),
        protocol.ENV_CHECKPOINT: str(values["checkpoint"]),
        protocol.ENV_CHECKPOINT_STEP: str(values["checkpoint_step"]),
        protocol.ENV_ATTEMPT: str(values["attempt"]),
        protocol.ENV_RUN_DIR: str(values["run_dir"]),
        protocol.ENV_EVENTS: str(files.events.resolve()),
        protocol.ENV_CHECKPOINT_REQUEST: str(files.checkpoint_request.resolve()),
        protocol.ENV_CHECKPOINT_SIGNAL: config.checkpoint_signal,
    })
    # Output must stream for OOM text to be seen as it happens; a hang dump needs faulthandler.
    env.pop("NOTIFY_SOCKET", None)  # systemd talks to the supervisor, not to its worker
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if plan.expandable_segments:
        env["PYTORCH_CUDA_ALLOC_CONF"] = with_expandable_segments(env.get("PYTORCH_CUDA_ALLOC_CONF"))
    return env


def expandable_already(env: Mapping[str, str]) -> bool:
    return "expandable_segments:true" in env.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
