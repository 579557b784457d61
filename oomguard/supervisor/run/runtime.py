"""What one attempt is started with: its argv (placeholders filled), environment and files."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import oomguard
from oomguard.common import protocol
from oomguard.probe import SITE_DIR
from oomguard.supervisor.command import render
from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide.classify import OwnCode
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.observe.checkpoints import Checkpoint

_PACKAGE = os.path.dirname(os.path.abspath(oomguard.__file__))
# Where the worker's tracebacks show our code: the probe's files (SITE_DIR is under this directory)
# and the spare's bootstrap are handed to it by these paths; with links resolved too.
OWN_CODE = OwnCode(tuple(dict.fromkeys((_PACKAGE, os.path.realpath(_PACKAGE)))))


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
        # summed over the ranks: for scripts that divide it by the world size (nanoGPT under torchrun)
        "grad_accum_total": batch.grad_accum * batch.world_size,
        "global_batch": batch.global_batch, "world_size": batch.world_size,
        "checkpoint": checkpoint.path if checkpoint else "",
        "checkpoint_step": checkpoint.step if checkpoint and checkpoint.step is not None else "",
        "attempt": attempt, "run_dir": str(config.run_dir.resolve()),
        "eval_micro_batch": plan.eval_micro_batch, "num_workers": plan.num_workers,
    }


def build_argv(config: RunConfig, plan: Plan, values: Mapping[str, object], has_checkpoint: bool) -> list[str]:
    """The command with placeholders filled, resume args (only with a checkpoint) and fallbacks."""
    argv = [render(token, values) for token in config.command]
    if has_checkpoint and config.checkpoints.resume_args:
        argv += [render(token, values) for token in shlex.split(config.checkpoints.resume_args)]
    for extra in config.batch.fallback_args[:plan.fallbacks_applied]:
        argv += [render(token, values) for token in shlex.split(extra)]
    return argv


# The allocator's settings live under two names. torch 2.13 (read in its installed source,
# c10/core/AllocatorConfig.h and c10/cuda/CUDAAllocatorConfig.h): the device-generic settings, among
# them expandable_segments, read PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF only when it is
# unset; the CUDA-only settings read PYTORCH_CUDA_ALLOC_CONF first. Releases before 2.9 read only
# PYTORCH_CUDA_ALLOC_CONF. So the option is merged into every name the user set (each keeps its
# own other settings and wins where it won before), and a name the user left unset gets the user's
# settings too, so that whichever name the worker's torch reads carries expandable_segments:True.
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def with_expandable_segments(current: str | None) -> str:
    """Allocator settings with expandable_segments:True, keeping the user's other settings."""
    parts = [p for p in (current or "").split(",")
             if p.strip() and not p.strip().startswith("expandable_segments")]
    return ",".join([*parts, "expandable_segments:True"])


def merge_alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables to set for expandable segments, given the worker's environment."""
    user = {name: env[name] for name in ALLOC_CONF_NAMES if env.get(name)}
    fallback = next(iter(user.values()), None)  # the new name's value first: it wins on new releases
    return {name: with_expandable_segments(user.get(name, fallback)) for name in ALLOC_CONF_NAMES}


def alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator settings the worker gets (for status): the names that are set."""
    return {name: env[name] for name in ALLOC_CONF_NAMES if env.get(name)}


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
        protocol.ENV_CHECKPOINT_SIGNAL: config.checkpoints.signal,
    })
    # Output must stream for OOM text to be seen as it happens; a hang dump needs faulthandler.
    env.pop("NOTIFY_SOCKET", None)  # systemd talks to the supervisor, not to its worker
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if plan.expandable_segments:
        env.update(merge_alloc_conf(env))
    if config.probe:
        env["PYTHONPATH"] = with_probe(env.get("PYTHONPATH", ""))
    return env


def with_probe(pythonpath: str) -> str:
    """The worker's PYTHONPATH with the probe's sitecustomize directory first: every Python process
    it starts (torchrun's and accelerate's ranks, data-loader workers) inherits it (docs/probe.md).
    The directory holds only sitecustomize.py, which runs the user's own one, so first shadows nothing."""
    rest = [entry for entry in pythonpath.split(os.pathsep) if entry and entry != SITE_DIR]
    return os.pathsep.join([SITE_DIR, *rest])


def expandable_already(env: Mapping[str, str]) -> bool:
    """The user set the option under the name their torch reads first (new name, else old)."""
    value = next((env[name] for name in ALLOC_CONF_NAMES if env.get(name)), "")
    return "expandable_segments:true" in value.replace(" ", "").lower()
