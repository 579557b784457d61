"""``oomguard report``: the morning summary of a run, built from its journal alone (so it works
during the run and long after it): when it ran, how much of that time was wasted, every failure
with its evidence and what oomguard did, how the batch changed, the steps redone, the checkpoints.

Tested in tests/unit/supervisor/record/test_report.py and tests/unit/supervisor/observe/test_progress.py.

The history is the picture (``picture.py``) and what only a pass over every event gives (each
attempt's highest step and last activity, every checkpoint write, the decisions, the in-process batch
changes, the warnings); progress records (one a step) are read a page at a time and only summarised.

* **lost time** of a failed attempt: from its last checkpoint the next attempt resumed from (the
  attempt's start when it wrote none that was used) to its end, plus the gap until the next attempt
  started. A checkpoint counts as written when it was first seen: one the next attempt rewrote under
  the same name (Lightning re-saves the one it resumed from) or that rotation deleted later still
  counts for the attempt that wrote it.
* **steps lost** (work redone): the attempt's last step minus the step of the checkpoint the next
  attempt resumed from (0 when it started over; the step before the first one the next attempt
  showed when it did not load its checkpoint, a ``not_resumed`` event). The last step comes from the
  worker's progress; for scripts that do not speak the worker protocol it is the newest checkpoint the
  attempt wrote (or resumed from), a lower bound, marked as such. Steps are redone whatever started
  the next attempt: a failure, ``oomguard restart``, a Ctrl-C and a rerun, a planned restart, ``--grow``.

The text (``format_report``) shares its wording of progress, peaks and worlds with status.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from oomguard.supervisor.lifecycle import Ending, StopReason
from oomguard.supervisor.record import memoryparts, picture
from oomguard.supervisor.record.journal import Journal, open_existing
from oomguard.supervisor.record.picture import INTERRUPTED, TERMINAL, Attempt, Checkpoint, Data, RunPicture, by_world
from oomguard.supervisor.units import format_size

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
    decisions: Mapping[int, Data]  # per attempt: its ``decision`` event's data
    resume_steps: Mapping[int, int]  # per attempt: the step it resumed from, as known when it started
    not_resumed: Mapping[int, Data]  # per attempt: started from a checkpoint it did not load

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]


def read_history(journal: Journal) -> RunHistory:
    run = picture.read_picture(journal)
    events, steps, last_t = _scan(journal)
    # every checkpoint write as first seen, with the file's bad mark; a journal from before writes were
    # kept has only each file's newest write
    bad = {c.path for c in run.checkpoints if c.bad}
    writes = (journal.checkpoint_writes()
              or [{"path": c.path, "mtime": c.mtime, "step": c.step} for c in run.checkpoints])
    return RunHistory(
        picture=run, events=tuple(events), steps=steps, last_activity=last_t,
        writes=tuple(Write(w["path"], w["mtime"], w["step"], w["path"] in bad) for w in writes),
        decisions={e.attempt: e.data for e in events if e.kind == "decision" and e.attempt},
        # a checkpoint file rewritten in place (nanoGPT's ckpt.pt) has a newer step in the table by now
        resume_steps={e.attempt: e.data["step"] for e in events
                      if e.kind == "resume_point" and isinstance(e.data.get("step"), int) and e.attempt},
        not_resumed={e.attempt: e.data for e in events if e.kind == "not_resumed" and e.attempt})


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


def failures_of(history: RunHistory) -> list[dict[str, Any]]:
    """One record per attempt that failed, or was interrupted (its supervisor died, or no end was
    recorded, yet another attempt followed). The user's stop, a planned restart and ``--grow`` are
    no failures: the attempt's ending says which it was."""
    attempts = history.picture.attempts
    return [_figures(a, nxt, history) for a, nxt in zip(attempts, (*attempts[1:], None), strict=True)
            if a.failed or (nxt is not None and a.ending in (None, Ending.INTERRUPTED))]


def restarts_of(history: RunHistory) -> list[dict[str, Any]]:
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


def _last_step(attempt: Attempt, reported: int | None, written: list[Write],
               resumed_step: int | None) -> tuple[int | None, str | None]:
    """The attempt's last step and where that figure comes from."""
    known = [s for s in (attempt.last_step, reported) if s is not None]
    if known:
        return max(known), "progress"
    bounds = [s for s in (*(w.step for w in written), resumed_step) if s is not None]
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


def _resume_point(nxt: Attempt, history: RunHistory) -> ResumePoint:
    """The checkpoint ``nxt`` started from, as it was when it started."""
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
    if nxt is None:
        return None
    resume = _resume_point(nxt, history)
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
    # good checkpoint writes made while the attempt ran, newest first
    written = sorted((w for w in history.writes if not w.bad and start <= w.mtime <= end), key=lambda w: w.mtime,
                     reverse=True)
    own = _resume_point(attempt, history) if attempt.checkpoint else None
    last_step, source = _last_step(attempt, history.steps.get(n), written, own.step if own else None)
    resume = _next_resume(nxt, history)
    # The next attempt showed an earlier first step than its checkpoint's: it redid everything from
    # that step on, whatever the checkpoint held.
    redone_from = None if resume is None else resume.step if resume.first_step is None else resume.first_step - 1
    steps_lost = None if redone_from is None or last_step is None else max(0, last_step - redone_from)
    return {
        "attempt": n, "kind": attempt.kind or INTERRUPTED, "started": start,
        "micro_batch": attempt.micro_batch, "grad_accum": attempt.grad_accum,
        "peak_allocated": attempt.peak_allocated, "exit_code": attempt.exit_code, "signal": attempt.signal,
        "exit": attempt.exit,
        "evidence": attempt.evidence or ("" if attempt.kind else "no exit recorded: the run was "
                                         "stopped or its supervisor ended during this attempt"),
        "decision": _decision_record(attempt, history),
        "cause": picture.plain(history.picture.causes.get(n)), "ended": end,
        "last_step": last_step, "last_step_source": source,
        "resumed_from": None if resume is None else resume.as_dict(),
        "steps_lost": steps_lost,
        "lost_s": _lost_seconds(start, end, resume, written),
        "gap_s": max(0.0, nxt.started - end) if nxt else 0.0,
    }


def _decision_record(attempt: Attempt, history: RunHistory) -> dict[str, Any] | None:
    """The decision event's figures; the words written on the attempt's row where it has none."""
    decision = history.decisions.get(attempt.number)
    if decision is None and not attempt.decision:
        return None
    record = {k: (decision or {}).get(k) for k in ("action", "reason", "micro_batch", "grad_accum")}
    if record["reason"] is None:
        record["reason"] = attempt.decision
    return record


# --- the report as data ---

_BATCH_KEYS = ("micro_batch", "grad_accum", "global_batch", "world_size", "expandable_segments",
               "fallbacks_applied")


def _span(history: RunHistory) -> tuple[float | None, float | None, float | None]:
    """(start, end, last activity): end is None while the run has not reached a terminal state."""
    run = history.picture
    times = [e.t for e in history.events] + [a.started for a in run.attempts]
    start = min(times) if times else run.meta.get("started")
    last = max([*times, *(a.ended for a in run.attempts if a.ended), run.updated or 0.0]) or None
    states = history.of_kind("state")
    ended = run.state in TERMINAL and states and states[-1].data.get("to") in TERMINAL
    return start, states[-1].t if ended else None, last


def _batch_history(history: RunHistory) -> list[dict[str, Any]]:
    """Each change of the batch configuration: at an attempt's start (the supervisor's plan) or
    inside an attempt (the worker library changed it in-process), in time order."""
    attempts = history.picture.attempts
    entries = [{"t": a.started, "attempt": a.number, "by": "supervisor",
                "reason": _plan_reason(a, attempts[i - 1] if i else None, history),
                **{k: a.row()[k] for k in _BATCH_KEYS}} for i, a in enumerate(attempts)]
    entries += [_worker_batch_entry(change, attempts) for change in history.of_kind("worker_batch")]
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
    decision = history.decisions.get(previous.number) or {}
    return str(decision.get("reason") or previous.decision or "continued")


def _worker_batch_entry(change: Event, attempts: tuple[Attempt, ...]) -> dict[str, Any]:
    """The worker library changed the batch in-process (a ``worker_batch`` event)."""
    plan = next((a for a in attempts if a.number == change.attempt), attempts[-1] if attempts else None)
    micro, accum = change.data.get("micro_batch"), change.data.get("grad_accum")
    world = plan.world_size if plan else 1
    return {"t": change.t, "attempt": change.attempt, "by": "worker", "reason": change.data.get("reason", ""),
            "micro_batch": micro, "grad_accum": accum,
            "global_batch": micro * accum * world if micro and accum else (plan.global_batch if plan else None),
            "world_size": world, "expandable_segments": plan.expandable_segments if plan else 0,
            "fallbacks_applied": plan.fallbacks_applied if plan else 0}


def _checkpoint_summary(checkpoints: tuple[Checkpoint, ...]) -> dict[str, Any]:
    good = [c for c in checkpoints if not c.bad]
    newest = {"path": good[0].path, "step": good[0].step, "mtime": good[0].mtime} if good else None
    return {"count": len(good), "newest": newest,
            "bad": [{"path": c.path, "step": c.step, "reason": c.reason} for c in checkpoints if c.bad]}


def build_report(journal: Journal) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints and the dashboard shows)."""
    history = read_history(journal)
    run = history.picture
    failures, restarts = failures_of(history), restarts_of(history)
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
        "peaks": picture.attempt_peaks(run.attempts),
        "planned_restarts": [{"attempt": a.number, "reason": a.decision,
                              "cause": picture.plain(run.causes.get(a.number))}
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


def read_report(run_dir: Path) -> dict[str, Any]:
    with closing(open_existing(run_dir)) as journal:
        return build_report(journal)


# --- the report as text ---


def format_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def progress_text(progress: dict[str, Any]) -> str:
    """``step 120/1000, 3.2 steps/s, ETA 5 min; allocated peak 1.2 GiB of 24.0 GiB (at 14:02:11)``."""
    total = progress.get("total_steps")
    text = f"step {progress.get('step')}" + (f"/{total}" if total else "")
    if progress.get("steps_per_s"):
        text += f", {progress['steps_per_s']:.3g} steps/s"
    if progress.get("eta_s") is not None:
        text += f", ETA {progress['eta_s'] / 60:.0f} min"
    if progress.get("allocated_peak"):
        text += f"; allocated peak {format_size(progress['allocated_peak'])}"
        if progress.get("limit_bytes"):
            text += f" of {format_size(progress['limit_bytes'])}"
    if progress.get("source") == "probe":
        text += " [probe]"
    elif progress.get("source") == "resume_point":  # a new attempt before its first step
        text += " [resumed from its checkpoint]"
    if progress.get("t"):
        text += f" (at {time.strftime('%H:%M:%S', time.localtime(progress['t']))})"
    return text


def peak_text(peak: dict[str, Any]) -> str:
    """``attempt 2 at micro-batch 8: allocated peak 1.2 GiB, GPU 1.9 GiB, RSS 412.0 MiB``."""
    parts = [f"{label} {format_size(peak[key])}" for key, label in
             (("peak_allocated", "allocated peak"), ("peak_gpu", "GPU"), ("peak_rss", "RSS")) if peak.get(key)]
    return f"attempt {peak['attempt']} at micro-batch {peak['micro_batch']}: " + (", ".join(parts) or "no reading")


def worlds_text(entries: Sequence[Mapping[str, Any]]) -> str | None:
    """``world 2: 1 min 20 s (2 attempts); world 1: 40.0 s (1 attempt)``; None for a single world
    (``picture.by_world``: a run that never changed its world has one entry, not repeated)."""
    if len(entries) < 2:
        return None
    return "; ".join(f"world {e['world_size']}: {format_duration(e['seconds'])} ({e['attempts']} attempt"
                     f"{'' if e['attempts'] == 1 else 's'})" for e in entries)


def _clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t is not None else "-"


def _batch_text(entry: dict[str, Any], asked: int | None = None) -> str:
    text = (f"micro {entry['micro_batch']} × accum {entry['grad_accum']} × world {entry['world_size']}"
            f" = {entry['global_batch']}")
    if asked is not None and asked != entry["global_batch"]:
        text += f" (asked {asked})"
    if entry["expandable_segments"]:
        text += ", expandable_segments"
    if entry["fallbacks_applied"]:
        text += f", {entry['fallbacks_applied']} fallback(s)"
    return text


def _header(report: dict[str, Any]) -> list[str]:
    total, lost = report["total_s"], report["lost_s"]
    share = f" ({100 * lost / total:.0f}%)" if total > 0 else ""
    ended = (_clock(report["ended"]) if report["finished"]
             else f"not finished (last activity {_clock(report['last_activity'])})")
    steps = f"{report['steps_lost']}" if report["steps_lost_exact"] else f"at least {report['steps_lost']}"
    if report["steps_lost_unknown"]:
        steps += f" (+ {report['steps_lost_unknown']} restart(s) with unknown steps)"
    return [
        f"run:         {report['run_dir']}",
        f"final state: {report['state']}: {report['reason']}",
        f"started:     {_clock(report['started'])}",
        f"ended:       {ended}",
        f"time:        {format_duration(total)} total, {format_duration(lost)} lost{share}",
        f"attempts:    {report['attempts']}, failures: {len(report['failures'])}, "
        f"steps lost (redone): {steps}",
    ]


def _failure_lines(failure: dict[str, Any]) -> list[str]:
    lines = [f"  attempt {failure['attempt']} at {_clock(failure['ended'])}: {failure['kind']} "
             f"at micro-batch {failure['micro_batch']} × accum {failure['grad_accum']} ({failure['exit']})",
             f"    evidence: {failure['evidence'] or '-'}"]
    if failure.get("cause"):
        lines.append(f"    cause:    {failure['cause']['summary']}")
    lines += memoryparts.lines(failure)
    decision = failure["decision"]
    if decision:
        action = f"{decision['action']}: " if decision["action"] else ""
        lines.append(f"    done:     {action}{decision['reason']}")
    lines.append(f"    lost:     {format_duration(failure['lost_s'])} of work, "
                 f"{format_duration(failure['gap_s'])} until the next attempt; {_steps_text(failure)}")
    return lines


def _steps_text(failure: dict[str, Any]) -> str:
    resumed = failure["resumed_from"]
    last = failure["last_step"]
    last_text = "last step unknown" if last is None else (
        f"last step {last}" if failure["last_step_source"] == "progress" else f"last step ≥ {last}")
    if resumed is None:
        return f"{last_text}; not resumed"
    where = f"step {resumed['step']}" if resumed["step"] is not None else "a checkpoint of unknown step"
    origin = f" ({resumed['path']})" if resumed["path"] else " (started over)"
    if last is None:  # no step seen in the attempt: none is known to have been taken, so none to redo
        nxt = f"resumed from {where}{origin}" if resumed["path"] else "started over"
        return f"no step seen in this attempt, none seen redone; the next {nxt}"
    lost = "?" if failure["steps_lost"] is None else str(failure["steps_lost"])
    if resumed.get("resumed") is False:  # started from the checkpoint, but the script did not load it
        first = resumed["first_step"]
        went = "started over at step 1" if first <= 1 else f"went back to step {first}"
        return f"{last_text}, {went} instead of resuming from {where}{origin}: {lost} step(s) redone"
    return f"{last_text}, resumed from {where}{origin}: {lost} step(s) redone"


def _checkpoint_lines(summary: dict[str, Any]) -> list[str]:
    newest = summary["newest"]
    text = f"checkpoints: {summary['count']} seen"
    if newest:
        step = f" (step {newest['step']})" if newest["step"] is not None else ""
        text += f", newest {newest['path']}{step}"
    return [text, *(f"  bad: {b['path']}: {b['reason'] or 'failed to load'}" for b in summary["bad"])]


def format_report(report: dict[str, Any]) -> str:
    lines = [*_header(report), "batch configuration over time:"]
    asked = report.get("asked_global_batch")
    if asked is not None:
        lines.append(f"  the script takes no accumulation: its global batch is micro × world (asked {asked})")
    for entry in report["batch_history"]:
        who = "" if entry["by"] == "supervisor" else f" (in-process by the worker: {entry['reason']})"
        why = f" — {entry['reason']}" if entry["by"] == "supervisor" and entry["reason"] else ""
        lines.append(f"  {_clock(entry['t'])} attempt {entry['attempt']}: {_batch_text(entry, asked)}{who}{why}")
    if (worlds := worlds_text(report.get("worlds") or [])) is not None:
        lines.append(f"time at each world size: {worlds}")
    lines.append("failures:" if report["failures"] else "failures:    none")
    lines += [line for failure in report["failures"] for line in _failure_lines(failure)]
    if planned := report.get("planned_restarts"):
        lines.append(f"planned restarts (before the limit, right after a checkpoint): {len(planned)}")
        for r in planned:
            lines.append(f"  attempt {r['attempt']}: {r['reason']}")
            if r["cause"]:
                lines.append(f"    cause:    {r['cause']['summary']}")
    lines += [f"stopped:     attempt {stop['attempt']} at {_clock(stop['at'])}, {stop['reason']}"
              for stop in report.get("stops") or []]
    redone = [r for r in report.get("restarts") or [] if r["steps_lost"] or r["steps_lost"] is None]
    if redone:
        lines.append("redone after restarts that were no failure (counted in steps lost):")
        lines += [f"  attempt {r['attempt']} ({r['ending']}): {_steps_text(r)}" for r in redone]
    lines += [f"warning:     attempt {w['attempt']}: {w['message']}" for w in report.get("warnings") or []]
    lines += _checkpoint_lines(report["checkpoints"])
    if any(p.get("peak_allocated") for p in report.get("peaks") or []):
        lines.append("memory per attempt (allocated: the allocator's highest step peak, from the probe):")
        lines += [f"  {peak_text(p)}" for p in report["peaks"]]
    if report["progress"]:
        lines.append(f"last progress: {progress_text(report['progress'])}")
    return "\n".join(lines)
