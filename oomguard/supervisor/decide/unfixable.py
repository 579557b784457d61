"""Errors no restart can fix: the rule that stops a run at once instead of retrying them.

A ``ModuleNotFoundError`` at import was run three times before the crash loop gave up, each time
paying the script's load time, and under systemd the whole give-up was then repeated. An error of
the script or its environment, raised before the first step, is the same at every restart:

- the same exception line (``ImportError``/``ModuleNotFoundError``, ``SyntaxError`` and its
  kin, ``FileNotFoundError`` of a file the script opens, argparse's ``prog: error: ...`` with exit
  status 2) in two attempts in a row, neither of which made progress, ends the run;
- once is enough where the class alone says it: a ``SyntaxError`` with no traceback before it is
  python failing to compile the script it was told to run.

The run then ends with ``lifecycle.exits.EXIT_UNFIXABLE`` (3), which a service manager must not restart. Pure: the
facts come from ``observe.output.OutputScanner`` through the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.supervisor.observe.output import OutputScanner

_COMPILE = ("SyntaxError", "IndentationError", "TabError")
USAGE_EXIT = 2  # argparse's exit status for a usage error


@dataclass(frozen=True)
class Fatal:
    """An error that ended an attempt before its first step and that a restart would meet again."""

    line: str  # the exception line (``ModuleNotFoundError: No module named 'wandb'``)
    alone: bool = False  # its class alone says no restart can fix it (the script does not compile)


def seen(scan: OutputScanner, exit_code: int | None, progressed: bool) -> Fatal | None:
    """The fatal error of an attempt that ended without progress; None when there is none."""
    if progressed:
        return None
    if scan.usage_error is not None and exit_code == USAGE_EXIT:
        return Fatal(scan.usage_error)
    if scan.fatal is None:
        return None
    return Fatal(scan.fatal, scan.fatal_untraced and scan.fatal.startswith(_COMPILE))


def give_up(fatal: Fatal | None, previous: Fatal | None, attempt: int) -> str | None:
    """Why the run ends now, or None when a restart may still help."""
    if fatal is None:
        return None
    if fatal.alone:
        return (f"{fatal.line}: the script does not compile, so no restart can fix it; fix the script and run "
                "oomguard again")
    if previous is not None and previous.line == fatal.line:
        return (f"{fatal.line}, before the first step in attempts {attempt - 1} and {attempt}: no restart can fix "
                "it; fix the script or its environment and run oomguard again")
    return None
