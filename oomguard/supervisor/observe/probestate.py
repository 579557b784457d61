"""Whether the probe (oomguard/probe/) is in the worker, and if not, why: for the journal and status.

The probe writes one ``probe`` record per process that trains (state loaded, at its first optimizer
step), one per failure, and one per part it leaves undone there by design (state partial: under
``torch.compile``, docs/probe.md). ``ProbeReport`` folds them into the ``probe`` entry of the journal's
meta: loaded in N processes, failed with the probe's own words, turned off (--no-probe), or none
seen yet and the likely reason (a command that is not Python, or no optimizer step taken yet).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from oomguard.supervisor.command.wrappers import SHELLS, unwrap

MAX_FAILURES = 8  # the first failures are the story; a thousand ranks failing alike are not news


def not_python(command: list[str] | tuple[str, ...]) -> str | None:
    """Why the command is not a Python program (the program it runs behind its wrappers, ``prlimit``,
    ``env``, ``nice``, ``taskset``, ``numactl``, ``bash -c``, is no interpreter and its file has no
    python shebang), or None when it is or cannot be told. A shell script may still start Python:
    its processes get the probe all the same."""
    argv = unwrap(command)
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if name.startswith(("python", "pypy")) or name.endswith(".py") or name in SHELLS:
        return None
    path = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
    try:
        with open(path or argv[0], "rb") as script:
            first = script.readline(256)
    except OSError:
        return None
    if first.startswith(b"#!") and b"python" in first:
        return None  # torchrun, accelerate, a console script
    return f"the command ({name}) is not Python"


@dataclass
class ProbeReport:
    """What the probe said during one attempt."""

    enabled: bool = True
    command_note: str | None = None  # not_python()'s answer for the attempt's command
    loaded: dict[int, int | None] = field(default_factory=dict)  # pid -> rank
    failures: list[dict[str, Any]] = field(default_factory=list)
    off_why: str | None = None  # why it is off, when not by --no-probe (it failed an earlier attempt)
    partial: list[dict[str, Any]] = field(default_factory=list)  # what it does not do there, by design

    @staticmethod
    def for_command(enabled: bool, argv: list[str] | tuple[str, ...], off_why: str | None = None) -> ProbeReport:
        return ProbeReport(enabled, not_python(argv) if enabled else None, off_why=None if enabled else off_why)

    def take(self, record: dict[str, Any]) -> None:
        """One ``probe`` record."""
        pid, state = record.get("pid"), record.get("state")
        if state == "loaded" and isinstance(pid, int):
            self.loaded[pid] = record.get("rank")
        elif state == "failed" and len(self.failures) < MAX_FAILURES:
            self.failures.append({"pid": pid, "rank": record.get("rank"), "detail": str(record.get("detail", ""))})
        elif state == "partial" and isinstance(pid, int):
            self.loaded[pid] = record.get("rank")  # only a loaded probe knows what it left undone
            if len(self.partial) < MAX_FAILURES:
                self.partial.append({"pid": pid, "rank": record.get("rank"), "detail": str(record.get("detail", ""))})

    def as_meta(self) -> dict[str, Any]:
        """The journal meta's ``probe``: state (loaded | failed | off | none), processes, failures, partial, why."""
        if not self.enabled:
            return {"state": "off", "why": self.off_why or "turned off (--no-probe)", "processes": 0, "failures": []}
        ranks = sorted({rank for rank in self.loaded.values() if rank is not None})
        if self.loaded:
            state, why = "loaded", ""
        elif self.failures:
            state, why = "failed", self.failures[0]["detail"]
        else:
            state = "none"
            why = self.command_note or "no process has imported torch and taken an optimizer step yet"
        return {"state": state, "why": why, "processes": len(self.loaded), "ranks": ranks,
                "failures": list(self.failures), **({"partial": list(self.partial)} if self.partial else {})}

