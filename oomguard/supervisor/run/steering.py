"""Whether oomguard can steer the command at all: checked at start.

oomguard recovers from an OOM by running the command again with a smaller micro-batch. A command
given no batch (``python train.py --batch-size 64``, or a batch in a settings file no ``--edit``
names) runs the same batch whatever the plan says: status showed ``64 × 2 = 128`` while the script
trained at 64 × 1, and each OOM "halved" a number nothing read, down to 1 and "the model does not
fit". So a command is refused, one line and exit 2, when nothing in it can carry the plan:

- no batch placeholder (``{micro_batch}``, ``{grad_accum}``, ``{grad_accum_total}``,
  ``{global_batch}``) in the command, ``--resume-args``, ``--fallback-args`` or an ``--edit``;
- no ``OOMGUARD_`` variable named in the command itself (``sh -c '... $OOMGUARD_MICRO_BATCH'``,
  ``python -c CODE``);
- and the script, read as ``run/wiring.py`` reads it (never run), neither imports the worker
  library nor reads one of the variables oomguard sets for each attempt.

A script that cannot be read at all (a module not installed here, a program that is not found) is
not refused on a guess.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from oomguard.supervisor.command.configedit import parse_edit
from oomguard.supervisor.command.placeholders import used
from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.run import wiring
from oomguard.worker import protocol

BATCH_PLACEHOLDERS = frozenset({"micro_batch", "grad_accum", "grad_accum_total", "global_batch"})
# Every variable an attempt is started with: a script that reads one of them talks to oomguard.
PLAN_ENV = frozenset(value for name, value in vars(protocol).items() if name.startswith("ENV_"))
FIX = ("put {micro_batch} where the script takes its batch (e.g. --batch-size {micro_batch}), name the settings "
       "file that holds it with --edit FILE:KEY={micro_batch}, or read the plan with oomguard's worker library "
       "(from oomguard import Session)")


def check(config: RunConfig, cwd: Path) -> None:
    """UsageError when a halving would change nothing the command runs."""
    texts = [*config.command, config.resume_args, *config.fallback_args,
             *(parse_edit(spec).value for spec in config.edits)]
    if used(texts) & BATCH_PLACEHOLDERS or any("OOMGUARD_" in text for text in texts):
        return
    found = _source(config.command, cwd)
    if found is None:  # nothing could be read: not refused on a guess
        return
    source, who = found
    if source is not None and wiring.uses_worker_library(source, cwd, PLAN_ENV):
        return
    raise UsageError("COMMAND", f"oomguard cannot steer this command: it passes no {{micro_batch}} or {{grad_accum}}, "
                     f"no --edit names a settings file, and {who} neither uses oomguard's worker library nor reads "
                     "an OOMGUARD_ variable, so a smaller micro-batch would change nothing it runs", FIX)


def _source(command: Sequence[str], cwd: Path) -> tuple[Path | None, str] | None:
    """(the file to read, its name for the message); no file for inline code (``python -c CODE``,
    ``sh -c CODE``: read with the command); None when nothing can be read."""
    script = wiring.script_of(command)
    if script is not None:
        path = wiring.locate(script, cwd)
        return (path, Path(script.name).name) if path is not None else None
    if len(command) > 1 and wiring.is_interpreter(command[0]) and "-c" in command[1:]:
        return None, "its inline code"
    found = shutil.which(command[0]) if command else None
    if found is None or wiring.is_interpreter(command[0]):
        return None
    return Path(found), command[0]
