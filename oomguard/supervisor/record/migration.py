"""Journals written by older oomguards, read as the current one writes them: the one place that
reads the words a supervisor wrote, once per row, as a journal is opened.

Journals from before the ``ending`` column (how an attempt ended, ``lifecycle.states.Ending``) say it
only through what they did write: a failure kind, or the decision's words. Everything else reads
the ending this gives, never the words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.supervisor.lifecycle.states import Ending

# The decisions older supervisors wrote (their wording: record/endings.py writes it today).
_INTERRUPTED = Ending.INTERRUPTED.value
_STOPPED = "stopped by"
_FINISHED = "finished"
_GROW = "grow"


def ending_of(row: Mapping[str, Any]) -> Ending | None:
    """How a journaled attempt ended; None while it has no recorded end."""
    if row.get("ending"):
        return Ending(row["ending"])
    if row["ended"] is None:
        return None
    return _old_ending(row["kind"], str(row["decision"] or ""))


def _old_ending(kind: str | None, decision: str) -> Ending:
    """A row written before the ``ending`` column: a kind means a failure; else the decision's words."""
    if kind:
        return Ending.HANG if kind == "hang" else Ending.FAILED
    if decision.startswith(_INTERRUPTED):
        return Ending.INTERRUPTED
    if decision.startswith(_STOPPED):
        return Ending.STOPPED
    if decision == _FINISHED:
        return Ending.FINISHED
    return Ending.GROW if decision.startswith(_GROW) else Ending.PLANNED_RESTART
