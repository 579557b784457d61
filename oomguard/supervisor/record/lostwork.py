"""A run's whole history from its journal, and the lost-time rules: what each attempt that another
followed cost, in time and in steps redone.

Tested in tests/unit/supervisor/record/test_report.py and tests/unit/supervisor/run/test_preflight.py.

The history is the picture (``picture.py``) and what only a pass over every event gives (each
attempt's highest step and last activity, every checkpoint write, the decisions, the in-process batch
changes, the warnings). Progress records are many (one a step) and are only summarised; one pass
reads them a page at a time.

* **lost time** of a failed attempt: from its last checkpoint the next attempt resumed from (the
  attempt's start when it wrote none that was used) to its end, plus the gap until the next attempt
  started (backoff and restart). A checkpoint counts as written when it was first seen: one the next
  attempt rewrote under the same name (Lightning re-saves the one it resumed from) or that rotation
  deleted later (``save_total_limit``) still counts for the attempt that wrote it.
* **steps lost** (work redone): the attempt's last step minus the step of the checkpoint the next
  attempt resumed from (0 when it started over; the step before the first one the next attempt
  showed when it was started from a checkpoint but did not load it, a ``not_resumed`` event). The
  last step comes from the worker's progress reports; for scripts that do not speak the worker
  protocol it is the newest checkpoint the attempt wrote (or resumed from), a lower bound, marked as
  such. Steps are redone whatever started the next attempt: after a failure, and also after the
  user's ``oomguard restart``, a Ctrl-C and a rerun, a planned restart and ``--grow``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from oomguard.supervisor.lifecycle import Ending
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.picture import INTERRUPTED, Attempt, Checkpoint, Data, RunPicture, read_picture

_PAGE = 5000
_STEP_EVENTS = ("worker_progress", "worker_checkpoint", "worker_step")
WARNINGS = ("not_resumed", "checkpoint_glob_unmatched")


@dataclass(frozen=True)
class Write:
    """One write of a checkpoint as first seen; ``bad`` when the file is marked bad now."""

    path: str
    mtime: float
    step: int | None
    bad: bool


@dataclass(frozen=True)
class Decision:
    """What the policy decided after an attempt (its ``decision`` event)."""

    action: str | None
    reason: str | None
    micro_batch: int | None
    grad_accum: int | None


@dataclass(frozen=True)
class BatchChange:
    """The worker library changed the batch in-process (a ``worker_batch`` event)."""

    t: float
    attempt: int | None
    micro_batch: int | None
    grad_accum: int | None
    reason: str


@dataclass(frozen=True)
class Event:
    t: float
    kind: str
    attempt: int | None
    data: Data


@dataclass(frozen=True)
class RunHistory:
    picture: RunPicture
    events: tuple[Event, ...]  # every event but the progress records, oldest first
    steps: Mapping[int, int]  # per attempt: the highest step it reported
    last_activity: Mapping[int, float]  # per attempt: its newest event
    writes: tuple[Write, ...]
    decisions: Mapping[int, Decision]
    resume_steps: Mapping[int, int]  # per attempt: the step it resumed from, as known when it started
    not_resumed: Mapping[int, Data]  # per attempt: started from a checkpoint it did not load
    batch_changes: tuple[BatchChange, ...]

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]


def read_history(journal: Journal) -> RunHistory:
    picture = read_picture(journal)
    events, steps, last_t = _scan(journal)
    by_attempt = [e for e in events if e.attempt is not None]
    return RunHistory(
        picture=picture, events=tuple(events), steps=steps, last_activity=last_t,
        writes=_writes(journal, picture.checkpoints),
        decisions={e.attempt: _decision(e.data) for e in by_attempt if e.kind == "decision" and e.attempt},
        # a checkpoint file rewritten in place (nanoGPT's ckpt.pt) has a newer step in the table by now
        resume_steps={e.attempt: e.data["step"] for e in by_attempt
                      if e.kind == "resume_point" and isinstance(e.data.get("step"), int) and e.attempt},
        not_resumed={e.attempt: e.data for e in by_attempt if e.kind == "not_resumed" and e.attempt},
        batch_changes=tuple(BatchChange(e.t, e.attempt, e.data.get("micro_batch"), e.data.get("grad_accum"),
                                        e.data.get("reason", "")) for e in events if e.kind == "worker_batch"))


def _scan(journal: Journal) -> tuple[list[Event], dict[int, int], dict[int, float]]:
    """One pass over every event: the ones kept, each attempt's highest step and last activity."""
    kept: list[Event] = []
    steps: dict[int, int] = {}
    last_t: dict[int, float] = {}
    since = 0
    while page := journal.events(since, _PAGE):
        since = page[-1]["id"]
        for event in page:
            attempt = event["attempt"]
            if attempt is not None:
                last_t[attempt] = max(last_t.get(attempt, 0.0), event["t"])
                step = event["data"].get("step")
                if event["kind"] in _STEP_EVENTS and isinstance(step, int):
                    steps[attempt] = max(steps.get(attempt, step), step)
            if event["kind"] != "worker_progress":
                kept.append(Event(event["t"], event["kind"], attempt, event["data"]))
    return kept, steps, last_t


def _decision(data: Mapping[str, Any]) -> Decision:
    return Decision(data.get("action"), data.get("reason"), data.get("micro_batch"), data.get("grad_accum"))


def _writes(journal: Journal, checkpoints: tuple[Checkpoint, ...]) -> tuple[Write, ...]:
    """Every checkpoint write as first seen, with the file's bad mark; a journal from before writes
    were kept has only each file's newest write."""
    bad = {c.path for c in checkpoints if c.bad}
    writes = journal.checkpoint_writes() or [{"path": c.path, "mtime": c.mtime, "step": c.step} for c in checkpoints]
    return tuple(Write(w["path"], w["mtime"], w["step"], w["path"] in bad) for w in writes)



def counts_as_failure(attempt: Attempt, nxt: Attempt | None) -> bool:
    """A failure, or an attempt with no recorded end (or interrupted) that another followed."""
    return attempt.failed or (nxt is not None and attempt.ending in (None, Ending.INTERRUPTED))


def failures(history: RunHistory) -> list[dict[str, Any]]:
    """One record per attempt that failed, or was interrupted (its supervisor died, or no end was
    recorded, yet another attempt followed). The user's stop, a planned restart and ``--grow`` are
    no failures: the attempt's ending says which it was."""
    attempts = history.picture.attempts
    return [_figures(a, nxt, history) for a, nxt in zip(attempts, (*attempts[1:], None), strict=True)
            if counts_as_failure(a, nxt)]


def restarts(history: RunHistory) -> list[dict[str, Any]]:
    """The steps redone after each attempt that ended without failing and was followed by another
    (a stop and a rerun, a restart asked for, a planned restart, --grow): counted like a failure's."""
    out = []
    attempts = history.picture.attempts
    for attempt, nxt in zip(attempts, attempts[1:], strict=False):
        if attempt.ending is None or attempt.failed or attempt.ending is Ending.INTERRUPTED:
            continue  # counted among the failures
        figures = _figures(attempt, nxt, history)
        out.append({"attempt": attempt.number, "ending": attempt.ending.value, "reason": attempt.decision,
                    **{k: figures[k] for k in ("last_step", "last_step_source", "resumed_from", "steps_lost")}})
    return out


def _written_during(writes: tuple[Write, ...], start: float, end: float) -> list[Write]:
    """Good checkpoint writes made while the attempt ran, newest first."""
    return sorted((w for w in writes if not w.bad and start <= w.mtime <= end), key=lambda w: w.mtime, reverse=True)


def _last_step(attempt: Attempt, reported: int | None, written: list[Write],
               resumed_step: int | None) -> tuple[int | None, str | None]:
    """The attempt's last step and where that figure comes from."""
    known = [s for s in (attempt.last_step, reported) if s is not None]
    if known:
        return max(known), "progress"
    bounds = [w.step for w in written if w.step is not None]
    if resumed_step is not None:
        bounds.append(resumed_step)
    return (max(bounds), "checkpoint") if bounds else (None, None)


@dataclass(frozen=True)
class ResumePoint:
    """Where the next attempt went on from: the checkpoint write it found (path None: it started
    over, at step 0), that write's step and mtime, whether the file is bad, and the first step it
    showed when it did not load the checkpoint (a ``not_resumed`` event)."""

    path: str | None
    step: int | None
    mtime: float | None
    bad: bool
    first_step: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report's ``resumed_from``."""
        missed = {"resumed": False, "first_step": self.first_step} if self.first_step is not None else {}
        return {"path": self.path, "step": self.step, **missed}


def _resume_point(nxt: Attempt | None, history: RunHistory) -> ResumePoint | None:
    """The checkpoint ``nxt`` started from, as it was when it started; None when there is no next attempt."""
    if nxt is None:
        return None
    if not nxt.checkpoint:
        return ResumePoint(None, 0, None, False)
    known = next((c for c in history.picture.checkpoints if c.path == nxt.checkpoint), None)
    step, mtime = (known.step, known.mtime) if known else (None, None)
    found = [w for w in history.writes if w.path == nxt.checkpoint and w.mtime <= nxt.started]
    if found:
        # That write's step, unknown when it was unknown: the file's step now may be a later write's.
        step, mtime = found[-1].step, found[-1].mtime
    return ResumePoint(nxt.checkpoint, step, mtime, bool(known and known.bad))


def _next_resume(nxt: Attempt | None, history: RunHistory) -> ResumePoint | None:
    """``_resume_point`` of the next attempt, with the step it knew when it started (a file rewritten
    in place holds a later one now) and, when it did not load the checkpoint, the first step it showed."""
    resume = _resume_point(nxt, history)
    if resume is None or nxt is None:
        return resume
    if resume.path and nxt.number in history.resume_steps:
        resume = replace(resume, step=history.resume_steps[nxt.number])
    missed = history.not_resumed.get(nxt.number)
    return resume if missed is None else replace(resume, first_step=missed["first_step"])


def _lost_seconds(start: float, end: float, resume: ResumePoint | None, written: list[Write]) -> float:
    """Time after the checkpoint work continued from: the one the next attempt loaded if this attempt
    wrote it; with no next attempt, or when that checkpoint turned out bad, this attempt's newest
    good one; else the attempt's start (all of it is redone, as when the next attempt did not resume)."""
    anchor = start
    if resume is not None and resume.first_step is not None:
        return max(0.0, end - start)
    if resume is not None and not resume.bad and resume.mtime is not None:
        if start <= resume.mtime <= end:
            anchor = resume.mtime
    elif written:
        anchor = written[0].mtime
    return max(0.0, end - anchor)


def _figures(attempt: Attempt, nxt: Attempt | None, history: RunHistory) -> dict[str, Any]:
    n, start = attempt.number, attempt.started
    # Closed later by the next supervisor: when that happened says nothing of when the attempt died.
    end = (None if attempt.ending is Ending.INTERRUPTED else attempt.ended) or history.last_activity.get(n, start)
    written = _written_during(history.writes, start, end)
    own = _resume_point(attempt, history) if attempt.checkpoint else None
    last_step, source = _last_step(attempt, history.steps.get(n), written, own.step if own else None)
    resume = _next_resume(nxt, history)
    # The next attempt showed an earlier first step than its checkpoint's: it redid everything from
    # that step on, whatever the checkpoint held.
    redone_from = None if resume is None else resume.step if resume.first_step is None else resume.first_step - 1
    steps_lost = None
    if redone_from is not None and last_step is not None:
        steps_lost = max(0, last_step - redone_from)
    return {
        **_attempt_facts(attempt, history), "ended": end,
        "last_step": last_step, "last_step_source": source,
        "resumed_from": None if resume is None else resume.as_dict(),
        "steps_lost": steps_lost,
        "lost_s": _lost_seconds(start, end, resume, written),
        "gap_s": max(0.0, nxt.started - end) if nxt else 0.0,
    }


def _attempt_facts(attempt: Attempt, history: RunHistory) -> dict[str, Any]:
    cause = history.picture.causes.get(attempt.number)
    return {
        "attempt": attempt.number, "kind": attempt.kind or INTERRUPTED, "started": attempt.started,
        "micro_batch": attempt.micro_batch, "grad_accum": attempt.grad_accum,
        "peak_allocated": attempt.peak_allocated, "exit_code": attempt.exit_code, "signal": attempt.signal,
        "exit": attempt.exit,
        "evidence": attempt.evidence or ("" if attempt.kind else "no exit recorded: the run was "
                                         "stopped or its supervisor ended during this attempt"),
        "decision": _decision_record(attempt, history),
        "cause": None if cause is None else dict(cause),
    }


def _decision_record(attempt: Attempt, history: RunHistory) -> dict[str, Any] | None:
    decision = history.decisions.get(attempt.number)
    if decision is None and not attempt.decision:
        return None
    if decision is None:
        return {"action": None, "reason": attempt.decision, "micro_batch": None, "grad_accum": None}
    reason = decision.reason if decision.reason is not None else attempt.decision
    return {"action": decision.action, "reason": reason, "micro_batch": decision.micro_batch,
            "grad_accum": decision.grad_accum}
