"""``oomguard report``: the morning summary of a run, built from its journal alone.

What a person wants after a night nobody watched: when it ran, how much of that time was wasted,
every failure with the evidence that named its kind and what oomguard did about it, how the batch
configuration changed, how much training was redone after resuming, the checkpoints, and how it
ended. The run comes from its history (``lostwork.py``, the journal read once), the time and steps
lost from the same module's rules, the text from ``reporttext.py``; so it works during the run and
long after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomguard.supervisor.lifecycle import Ending, StopReason
from oomguard.supervisor.record import lostwork, memoryparts
from oomguard.supervisor.record.journal import Journal, open_existing
from oomguard.supervisor.record.lostwork import WARNINGS, RunHistory, read_history
from oomguard.supervisor.record.picture import TERMINAL, Attempt, Checkpoint, attempt_peaks, by_world
from oomguard.supervisor.record.reporttext import format_duration, format_report

__all__ = ["build_report", "format_duration", "format_report", "read_report"]

_BATCH_KEYS = ("micro_batch", "grad_accum", "global_batch", "world_size", "expandable_segments",
               "fallbacks_applied")


def _span(history: RunHistory) -> tuple[float | None, float | None, float | None]:
    """(start, end, last activity): end is None while the run has not reached a terminal state."""
    run = history.picture
    times = [e.t for e in history.events] + [a.started for a in run.attempts]
    start = min(times) if times else run.meta.get("started")
    last = max([*times, *(a.ended for a in run.attempts if a.ended), run.updated or 0.0]) or None
    states = history.of_kind("state")
    end = None
    if run.state in TERMINAL and states and states[-1].data.get("to") in TERMINAL:
        end = states[-1].t
    return start, end, last


def _batch_history(history: RunHistory) -> list[dict[str, Any]]:
    """Each change of the batch configuration: at an attempt's start (the supervisor's plan) or
    inside an attempt (the worker library changed it in-process), in time order."""
    attempts = history.picture.attempts
    entries = [{"t": a.started, "attempt": a.number, "by": "supervisor",
                "reason": _plan_reason(a, attempts[i - 1] if i else None, history),
                **{k: a.row()[k] for k in _BATCH_KEYS}} for i, a in enumerate(attempts)]
    entries += [_worker_batch_entry(change, attempts) for change in history.batch_changes]
    entries.sort(key=lambda e: e["t"])
    out: list[dict[str, Any]] = []
    for entry in entries:
        entry["expandable_segments"] = bool(entry["expandable_segments"])
        if not out or any(out[-1][k] != entry[k] for k in _BATCH_KEYS):
            out.append(entry)
    return out


def _plan_reason(attempt: Attempt, previous: Attempt | None, history: RunHistory) -> str:
    """Why the attempt ran with its plan: the decision after the attempt before it (a failure's,
    or a planned restart's such as --grow), else where the run started."""
    if previous is None:
        return "initial" if attempt.number == 1 else "continued"
    decision = history.decisions.get(previous.number)
    return str((decision.reason if decision else None) or previous.decision or "continued")


def _worker_batch_entry(change: Any, attempts: tuple[Attempt, ...]) -> dict[str, Any]:
    plan = next((a for a in attempts if a.number == change.attempt), attempts[-1] if attempts else None)
    micro, accum = change.micro_batch, change.grad_accum
    world = plan.world_size if plan else 1
    return {"t": change.t, "attempt": change.attempt, "by": "worker", "reason": change.reason,
            "micro_batch": micro, "grad_accum": accum,
            "global_batch": micro * accum * world if micro and accum else (plan.global_batch if plan else None),
            "world_size": world, "expandable_segments": plan.expandable_segments if plan else 0,
            "fallbacks_applied": plan.fallbacks_applied if plan else 0}


def _checkpoint_summary(checkpoints: tuple[Checkpoint, ...]) -> dict[str, Any]:
    good = [c for c in checkpoints if not c.bad]
    newest = good[0] if good else None
    return {
        "count": len(good),
        "newest": None if newest is None else {"path": newest.path, "step": newest.step, "mtime": newest.mtime},
        "bad": [{"path": c.path, "step": c.step, "reason": c.reason} for c in checkpoints if c.bad],
    }


def build_report(journal: Journal) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints and the dashboard shows)."""
    return report_of(read_history(journal))


def report_of(history: RunHistory) -> dict[str, Any]:
    run = history.picture
    failures, restarts = lostwork.failures(history), lostwork.restarts(history)
    # what filled memory at each failure, beside the attempt that fit (record/memoryparts.py)
    memoryparts.annotate(failures, run.breakdowns, [e.data for e in history.of_kind(memoryparts.COMPARISON)])
    start, end, last = _span(history)
    finish = end if end is not None else last
    total = finish - start if start is not None and finish is not None else 0.0
    lost = sum(f["lost_s"] + f["gap_s"] for f in failures)
    return {
        "run_dir": run.run_dir, "state": run.state, "reason": run.reason,
        "finished": end is not None, "started": start, "ended": end, "last_activity": last,
        "total_s": total, "lost_s": min(lost, total) if total else lost, "attempts": len(run.attempts),
        "batch_history": _batch_history(history),
        # time at each world size (an elastic run that lost a node)
        "worlds": by_world(run.attempts, finish),
        "asked_global_batch": run.plan.asked_global,  # None: the global batch was kept
        "failures": failures,
        "restarts": restarts,
        **_steps_lost([*failures, *restarts]),
        "checkpoints": _checkpoint_summary(run.checkpoints),
        "progress": run.meta.get("progress"),
        "peaks": attempt_peaks(run.attempts),
        "planned_restarts": [{"attempt": a.number, "reason": a.decision, "cause": _data(run.causes.get(a.number))}
                             for a in run.attempts if a.ending is Ending.PLANNED_RESTART
                             and a.stop_reason != StopReason.RESTART.value],
        "stops": [{"attempt": a.number, "at": a.ended, "reason": a.decision}
                  for a in run.attempts if a.ending is Ending.STOPPED],
        "warnings": [{"attempt": e.attempt, "kind": e.kind, "message": e.data.get("message", "")}
                     for e in history.of_kind(*WARNINGS)],
    }


def _steps_lost(redone: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps redone after every attempt another followed, whether that count is exact, and how
    many restarts it does not know. Unknown: steps were seen but the resume point's step is not known;
    an attempt that showed no step is no unknown: none was seen, so none is counted redone."""
    unknown = [f for f in redone if f["steps_lost"] is None and f["resumed_from"] is not None
               and f["last_step"] is not None]
    return {"steps_lost": sum(f["steps_lost"] or 0 for f in redone),
            "steps_lost_exact": not unknown and all(f["last_step_source"] != "checkpoint" for f in redone
                                                    if f["steps_lost"] is not None),
            "steps_lost_unknown": len(unknown)}


def _data(data: Any) -> dict[str, Any] | None:
    return None if data is None else dict(data)


def read_report(run_dir: Path) -> dict[str, Any]:
    journal = open_existing(run_dir)
    try:
        return build_report(journal)
    finally:
        journal.close()
