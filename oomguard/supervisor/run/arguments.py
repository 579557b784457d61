"""Reading ``oomguard run``'s arguments outside ``oomguard run``, and saying what a mistyped line meant.

``oomguard service`` writes a unit that runs ``oomguard run ARGS`` later, under systemd, where a typo
in ARGS would only show when the unit starts. ``check_run_args`` reads ARGS as ``oomguard run`` does
(the options generated from ``RunConfig``, its validation, the start checks of ``preflight``), so a
unit is written only for a command that would start.

An argument argparse does not know is often the training command with its ``--`` forgotten
(``oomguard run --micro-batch 8 python train.py``): ``unrecognized`` says to put ``--`` before it, and
names the option a mistyped one was probably meant to be (``--micro-bach`` -> ``--micro-batch``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NoReturn

from oomguard.supervisor.config import RunConfig, add_arguments, build_config, fragment_flags, join_fragments
from oomguard.supervisor.errors import UsageError

_LAUNCHERS = re.compile(r"^(python[0-9.]*|pypy[0-9.]*|torchrun|accelerate|deepspeed|uv|bash|sh)$")


def looks_like_command(word: str) -> bool:
    """``python``, ``torchrun``, ``./train.sh``, ``train.py`` or any program on PATH."""
    if not word or word.startswith("-"):
        return False
    return bool(_LAUNCHERS.match(Path(word).name)) or os.sep in word or word.endswith((".py", ".sh")) \
        or shutil.which(word) is not None


def unrecognized(extras: Sequence[str], flags: Iterable[str], subcommand: str | None) -> str:
    """The one-line message for arguments argparse did not take."""
    text = f"unrecognized arguments: {' '.join(extras)}"
    first = extras[0]
    if subcommand in ("run", "service") and looks_like_command(first):
        form = "oomguard service [options] -- [run options] --" if subcommand == "service" \
            else "oomguard run [options] --"
        return f"{text}; put -- before the training command: {form} {' '.join(extras)}"
    if first.startswith("-"):
        close = difflib.get_close_matches(first.partition("=")[0], sorted(flags), n=1, cutoff=0.6)
        if close:
            return f"{text} (did you mean {close[0]}?)"
    return text


class _Raising(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors (``oomguard service`` reports them as its own)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError("", f"in the oomguard run arguments: {message}", "see oomguard run --help")


def check_run_args(args: Sequence[str], cwd: Path, subcommand: str = "service") -> RunConfig:
    """The RunConfig that ``oomguard run ARGS`` would run in ``cwd``, with every check it makes at
    start; UsageError (one line) for what it would refuse."""
    from oomguard.supervisor.command.configedit import check_edits
    from oomguard.supervisor.run.preflight import check

    args = list(args)
    options, command = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
    parser = _Raising(prog="oomguard run", add_help=False)
    add_arguments(parser)
    namespace, extras = parser.parse_known_args(join_fragments(options, fragment_flags()))
    if extras:
        flags = parser._option_string_actions
        raise UsageError("", f"in the oomguard run arguments: {unrecognized(extras, flags, subcommand)}")
    config = build_config(vars(namespace), command)
    check(config, cwd)
    check_edits(config.edits, config.command, cwd)
    return config
