"""Reading ``oomguard run``'s arguments outside ``oomguard run``, and saying what a mistyped line meant.

Tested in tests/unit/supervisor/run/test_preflight.py.

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
import shlex
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


def unrecognized(extras: Sequence[str], flags: Iterable[str], subcommand: str | None,
                 typed: Sequence[str] = ()) -> str:
    """The one-line message for arguments argparse did not take; ``typed`` is every word the user
    gave the subcommand, so the suggested line keeps the script's flags argparse took as oomguard's
    (``--grad-accum {grad_accum}``, ``--port 9000``)."""
    text = f"unrecognized arguments: {' '.join(extras)}"
    first = extras[0]
    if subcommand in ("run", "service") and looks_like_command(first):
        start = _position(typed, extras)
        if start is None:
            return f"{text}; put -- before the training command: {_form(subcommand, None, extras)}"
        return f"{text}; put -- before the training command: {_form(subcommand, typed[:start], typed[start:])}"
    if first.startswith("-"):
        close = difflib.get_close_matches(first.partition("=")[0], sorted(flags), n=1, cutoff=0.6)
        if close:
            return f"{text} (did you mean {close[0]}?)"
    return text


def ambiguous(message: str, typed: Sequence[str], parser: argparse.ArgumentParser, subcommand: str) -> str:
    """argparse's ``ambiguous option: --resume could match --resume-args, --resumes-itself`` is most
    often the script's own flag with the ``--`` forgotten: say so, with the line as it was meant."""
    if not message.startswith("ambiguous option") or subcommand not in ("run", "service"):
        return message
    start = _command_start(typed, parser)
    if start is None:
        return message
    option = message.split(":", 1)[1].split()[0]
    return (f"{message}; if {option} is the training script's, put -- before the training command: "
            f"{_form(subcommand, typed[:start], typed[start:])}")


def _form(subcommand: str, options: Sequence[str] | None, command: Sequence[str]) -> str:
    """The command line as it was meant, every word kept and quoted as a shell needs."""
    run = "[options]" if options is None else shlex.join(options)
    head = f"oomguard service [options] -- {run}" if subcommand == "service" else f"oomguard run {run}"
    return f"{' '.join(head.split())} -- {shlex.join(command)}"


def _position(typed: Sequence[str], extras: Sequence[str]) -> int | None:
    """Where the training command starts in ``typed``: the first place from which the words
    argparse did not take follow in order."""
    for start in (i for i, word in enumerate(typed) if word == extras[0]):
        rest = iter(typed[start:])
        if all(any(word == extra for word in rest) for extra in extras):
            return start
    return None


def _command_start(typed: Sequence[str], parser: argparse.ArgumentParser) -> int | None:
    """The first word that looks like a command and is no option's value."""
    skip = False
    for i, word in enumerate(typed):
        if skip:
            skip = False
            continue
        if word.startswith("-"):
            action = parser._option_string_actions.get(word.partition("=")[0])
            skip = action is not None and action.nargs != 0 and "=" not in word
            continue
        if looks_like_command(word):
            return i
    return None


class _Raising(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors (``oomguard service`` reports them as its own)."""

    typed: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        message = ambiguous(message, self.typed, self, "service")
        raise UsageError("", f"in the oomguard run arguments: {message}", "see oomguard run --help")


def check_run_args(args: Sequence[str], cwd: Path, subcommand: str = "service") -> RunConfig:
    """The RunConfig that ``oomguard run ARGS`` would run in ``cwd``, with every check it makes at
    start; UsageError (one line) for what it would refuse."""
    from oomguard.supervisor.command import check_edits
    from oomguard.supervisor.run.preflight import check

    args = list(args)
    options, command = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
    parser = _Raising(prog="oomguard run", add_help=False)
    add_arguments(parser)
    parser.typed = options
    namespace, extras = parser.parse_known_args(join_fragments(options, fragment_flags()))
    if extras:
        flags = parser._option_string_actions
        raise UsageError("", f"in the oomguard run arguments: {unrecognized(extras, flags, subcommand, options)}")
    config = build_config(vars(namespace), command)
    check(config, cwd)
    check_edits(config.edits, config.command, cwd)
    return config
