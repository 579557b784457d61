"""The runs on a machine, found by their journals: what ``oomguard ls`` and the many-runs page list.

Each run is summarised from its journal alone (its picture, ``picture.read_picture``, as status
renders it), so a finished run, a run whose supervisor was killed and a running one read the same
way and no run's server has to be up.
A journal that cannot be read is listed with the reason ``damage.py`` found, never a traceback and
never the end of the listing.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.record.journal import JOURNAL_NAME, open_existing
from oomguard.supervisor.record.picture import TERMINAL, read_picture
from oomguard.supervisor.record.status import StatusDoc, status_of

MAX_DEPTH = 4  # directories below each root that are searched: runs/<project>/<experiment>/<run> and no deeper
# Never runs, often huge: walking them would make ``ls`` slow for nothing.
SKIP = frozenset({"node_modules", "__pycache__", "site-packages", "venv", "wandb", "mlruns"})

# The supervisor column: is the process that wrote the journal still there?
ALIVE, EXITED, GONE = "alive", "exited", "gone"  # gone: killed before it could record an ending
DAMAGED = "damaged"  # the state of a run whose journal cannot be read


def find_runs(roots: Sequence[Path], max_depth: int = MAX_DEPTH) -> list[Path]:
    """Every run directory (one holding a journal) at or below each root, each once, sorted."""
    found: dict[Path, None] = {}
    for root in roots:
        for run_dir in _walk(Path(root).resolve(), max_depth):
            found.setdefault(run_dir, None)
    return sorted(found)


def _walk(directory: Path, depth: int) -> Iterator[Path]:
    if (directory / JOURNAL_NAME).is_file():
        yield directory
        return  # a run's directory holds its logs and state, not other runs
    if depth <= 0:
        return
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:  # unreadable or vanished meanwhile: nothing to list there
        return
    for entry in entries:
        hidden = entry.name.startswith(".")
        if not hidden and entry.name not in SKIP and entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path), depth - 1)


def summarize(run_dir: Path) -> dict[str, Any]:
    """One run's line as data: state and why, batch, failures, newest checkpoint, last progress,
    whether its supervisor is alive and where its dashboard is."""
    try:
        journal = open_existing(run_dir)
    except UsageError as exc:  # JournalDamaged, or the journal went away since it was found
        return _unreadable(run_dir, exc.problem)
    try:
        picture = read_picture(journal)
        doc = status_of(picture)
        # on a network bind, the address others open (web/addresses.py), not this machine's loopback
        web_url = (picture.meta.get("web_public") or [picture.meta.get("web_url")])[0]
    except sqlite3.OperationalError as exc:
        if str(exc).startswith("no such table"):  # damage.py let it through: a supervisor is creating it
            return {**_unreadable(run_dir, "the journal is being created"), "state": "starting"}
        return _unreadable(run_dir, f"the journal cannot be read: {exc}")
    except sqlite3.DatabaseError as exc:
        return _unreadable(run_dir, f"the journal cannot be read: {exc}")
    finally:
        journal.close()
    return _summary(run_dir, doc, web_url)


def _summary(run_dir: Path, doc: StatusDoc, web_url: str | None) -> dict[str, Any]:
    alive = doc.supervisor_alive
    supervisor = ALIVE if alive else EXITED if doc.state in TERMINAL else GONE
    kinds = Counter(f.kind for f in doc.failures)
    newest = doc.newest_checkpoint or {}
    progress = doc.progress or {}
    return {
        "run_dir": str(run_dir), "state": doc.state, "reason": doc.reason, "supervisor": supervisor,
        "supervisor_pid": doc.supervisor_pid, "attempt": doc.attempt,
        "micro_batch": doc.micro_batch, "grad_accum": doc.grad_accum, "world_size": doc.world_size,
        "global_batch": doc.global_batch, "failures": sum(kinds.values()), "failure_kinds": dict(kinds),
        "checkpoint": newest.get("path"), "checkpoint_step": newest.get("step"),
        "step": progress.get("step"), "total_steps": progress.get("total_steps"),
        "progress_time": progress.get("t"), "samples_per_s": progress.get("samples_per_s"),
        "updated": doc.updated, "dashboard": web_url if alive else None,
        "degraded": [f"{p['component']}: {p['message']}" for p in doc.degraded],
        # said while it ran (a glob that missed the checkpoints, a resume that did not happen): a run
        # that succeeded with one is not plainly "succeeded"
        "warnings": [str(w["message"]) for w in doc.warnings],
        "error": None,
    }


def _unreadable(run_dir: Path, why: str) -> dict[str, Any]:
    empty = dict.fromkeys(("supervisor_pid", "attempt", "micro_batch", "grad_accum", "world_size", "global_batch",
                           "checkpoint", "checkpoint_step", "step", "total_steps", "progress_time",
                           "samples_per_s", "updated", "dashboard"))
    return {"run_dir": str(run_dir), "state": DAMAGED, "reason": why, "supervisor": None, **empty,
            "failures": None, "failure_kinds": {}, "degraded": [], "warnings": [], "error": why}


def list_runs(roots: Sequence[Path], max_depth: int = MAX_DEPTH) -> list[dict[str, Any]]:
    return [summarize(run_dir) for run_dir in find_runs(roots, max_depth)]


# --- as text ----------------------------------------------------------------------------------

COLUMNS = ("RUN", "STATE", "ATTEMPT", "BATCH", "FAILURES", "CHECKPOINT", "PROGRESS", "SUPERVISOR", "DASHBOARD",
           "WHY")


def format_runs(rows: list[dict[str, Any]], now: float | None = None, cwd: Path | None = None) -> str:
    """A table, one run a line; the reason comes last since it is the one long column."""
    now = time.time() if now is None else now
    cells = [COLUMNS] + [_cells(row, now, cwd or Path.cwd()) for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(line, widths, strict=False)), line[-1]]).rstrip()
                     for line in cells)


def _cells(row: dict[str, Any], now: float, cwd: Path) -> tuple[str, ...]:
    name = _shown_path(Path(row["run_dir"]), cwd)
    if row["error"] is not None:
        return (name, row["state"], *(["-"] * 7), row["reason"])
    batch = (f"{row['micro_batch']} × {row['grad_accum']} × {row['world_size']} = {row['global_batch']}"
             if row["grad_accum"] else "-")
    warned = len(row["warnings"])
    state = row["state"] + (f", {warned} warning{'s' if warned > 1 else ''}" if warned else "")
    return (name, state, str(row["attempt"]), batch, _failures(row), _checkpoint(row),
            _progress(row, now), _supervisor(row), row["dashboard"] or "-", _why(row))


def _shown_path(path: Path, cwd: Path) -> str:
    try:
        return str(path.relative_to(cwd.resolve())) or "."
    except ValueError:
        return str(path)


def _failures(row: dict[str, Any]) -> str:
    kinds = row["failure_kinds"]
    if not kinds:
        return "0"
    return f"{row['failures']} (" + ", ".join(k if n == 1 else f"{k} ×{n}" for k, n in sorted(kinds.items())) + ")"


def _checkpoint(row: dict[str, Any]) -> str:
    if not row["checkpoint"]:
        return "-"
    step = row["checkpoint_step"]
    return Path(row["checkpoint"]).name + (f" (step {step})" if step is not None else "")


def _progress(row: dict[str, Any], now: float) -> str:
    if row["step"] is None:
        return "-"
    total = f"/{row['total_steps']}" if row["total_steps"] else ""
    when = f" ({ago(now - row['progress_time'])})" if row["progress_time"] else ""
    return f"step {row['step']}{total}{when}"


def ago(seconds: float) -> str:
    """``12 s ago``, ``4 min ago``, ``3 h ago``, ``2 d ago``."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _supervisor(row: dict[str, Any]) -> str:
    if row["supervisor"] == ALIVE:
        return f"alive (pid {row['supervisor_pid']})"
    return row["supervisor"] or "-"


def _why(row: dict[str, Any]) -> str:
    why = str(row["reason"])
    if row["supervisor"] == GONE:
        why = f"the supervisor (pid {row['supervisor_pid']}) is gone; it last recorded: {why}"
    return "; ".join([*(f"warning: {w}" for w in row["warnings"]), why, *(f"degraded: {d}" for d in row["degraded"])])


# --- the command line ---------------------------------------------------------------------


def depth(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value
