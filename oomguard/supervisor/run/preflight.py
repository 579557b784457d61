"""Find at start what would otherwise fail at 3 a.m.: render every later attempt once, now.

The first restart is the moment oomguard exists for, and the first time ``--resume-args`` and the
fallbacks are rendered: an unbalanced quote there used to crash the supervisor then, hours in.
``check`` renders the command exactly as a restart from a checkpoint with every fallback applied
would (sample values with spaces and quotes in the checkpoint path), builds that attempt's
environment, and checks that the command can be started at all (it exists and is executable), that
the script and its settings files exist and that a watched checkpoint reaches the script
(``run/wiring.py``), so each of these is one line and exit 2 before anything runs.

``notices`` are the lines said at start about forms that run but not as a reader might think: a
script that cannot accumulate, a script given the per-rank accumulation where it takes the total,
an ``accelerate launch`` that starts fewer processes than it names.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from oomguard.supervisor.command.accumulation import Carrier, no_accumulation_line, total_warning
from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.distributed import launcher
from oomguard.supervisor.distributed.accelerate import AccelerateLaunch
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.run import steering, wiring
from oomguard.supervisor.run.runtime import AttemptFiles, build_argv, build_env, placeholder_values

SAMPLE_CHECKPOINT = "/tmp/a run's dir/ckpt step-100.pt"  # a space and a quote: quoting must survive it


def check(config: RunConfig, cwd: Path | None = None) -> list[str]:
    """The argv of a restart from a checkpoint with every fallback applied; UsageError if any of
    it cannot be rendered or started."""
    _check_splits(config)
    plan = Plan(config.initial_plan, True, len(config.fallback_args))
    sample = Checkpoint(SAMPLE_CHECKPOINT, 100, 0.0, 1)
    values = placeholder_values(config, plan, 2, sample)
    try:
        argv = build_argv(config, plan, values, has_checkpoint=True)
        env = build_env(config, plan, values, AttemptFiles.of(config.run_dir, 2))
    except (ValueError, KeyError, IndexError) as exc:
        raise UsageError("COMMAND", f"cannot be rendered for a restart ({exc})",
                         "check the placeholders in the command, --resume-args and --fallback-args") from None
    _check_executable(argv[0], env, cwd or Path.cwd())
    wiring.check(config, cwd or Path.cwd())  # the script exists, and something hands it its checkpoint
    steering.check(config, cwd or Path.cwd())  # and something hands it the batch
    return argv


def notices(config: RunConfig, cwd: Path | None = None) -> list[str]:
    """One line each, said at start, for what runs differently from how it reads."""
    lines = []
    launch = launcher.parse(config.command)
    if isinstance(launch, AccelerateLaunch) and launch.note:
        lines.append(launch.note)
    batch = config.initial_plan
    if config.accumulation is Carrier.NONE:
        lines.append(no_accumulation_line(batch.micro_batch, batch.world_size, config.allow_smaller_global_batch))
    warning = total_warning(config.command, launcher.program(config.command), cwd or Path.cwd(), batch.grad_accum,
                            batch.world_size, batch.micro_batch)
    if warning is not None:
        lines.append(warning)
    return lines


def _check_splits(config: RunConfig) -> None:
    """``--resume-args`` and each ``--fallback-args`` are split like a shell would split them."""
    texts = [("--resume-args", config.resume_args), *(("--fallback-args", f) for f in config.fallback_args)]
    for option, text in texts:
        try:
            shlex.split(text)
        except ValueError as exc:
            raise UsageError(option, f"{text!r} cannot be split into arguments ({exc})",
                             "balance the quotes, e.g. --resume-args \"--resume '{checkpoint}'\"") from None


def _check_executable(program: str, env: dict[str, str], cwd: Path) -> None:
    """The launcher would fail with exit 127 after three attempts; say so now."""
    if not program:
        raise UsageError("COMMAND", "the command is empty", "put the training command after --")
    if os.sep in program:
        path = program if os.path.isabs(program) else str(cwd / program)
        if not os.path.exists(path):
            raise UsageError("COMMAND", f"{program} does not exist", "check the path of the training command")
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            raise UsageError("COMMAND", f"{program} is not an executable file",
                             f"chmod +x {program}, or run it through its interpreter (python {program})")
        return
    if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise UsageError("COMMAND", f"{program!r} is not found on PATH", "install it or give its full path")
