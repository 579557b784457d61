"""``oomguard report``: the morning summary of a run, built from its journal alone.

What a person wants after a night nobody watched: when it ran, how much of that time was wasted,
every failure with the evidence that named its kind and what oomguard did about it, how the batch
configuration changed, how much training was redone after resuming, the checkpoints, and how it
ended. ``build_report`` only reads the journal, so it works during the run and long after it.

Two figures need a definition:

* **lost time** of a failed attempt: from its last checkpoint the next attempt resumed from (the
  attempt's start when it wrote none that was used) to its end, plus the gap until the next attempt
  started (backoff and restart). A checkpoint counts as written when it was first seen: one the next
  attempt rewrote under the same name (Lightning re-saves the one it resumed from) or that rotation
  deleted later (``save_total_limit``) still counts for the attempt that wrote it.
* **steps lost** (work redone): the failed attempt's last step minus the step of the checkpoint the
  next attempt resumed from (0 when it started over; the step before the first one the next attempt
  showed when it was started from a checkpoint but did not load it, a ``not_resumed`` event). The
  last step comes from the worker's progress
  reports; for scripts that do not speak the worker protocol it is the newest checkpoint the attempt
  wrote (or resumed from), a lower bound, marked as such. Steps are redone whatever started the
  next attempt, so the total counts them after every attempt another followed: a failure, and
  also the user's ``oomguard restart``, a Ctrl-C and a rerun, a planned restart and ``--grow``
  (``restarts``: the same figures for the attempts that ended without failing).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.lifecycle.states import Ending, StopReason, exit_text
from oomguard.supervisor.record.figures import attempt_peaks, peak_text, progress_text
from oomguard.supervisor.record.journal import Journal, open_existing

TERMINAL = ("succeeded", "failed", "stopped")
INTERRUPTED = Ending.INTERRUPTED.value  # an attempt that ended without a recorded exit (its supervisor died)
# The decision a restarted supervisor writes for an attempt its killed predecessor left open.
CLOSED_INTERRUPTED = f"{INTERRUPTED}: its supervisor ended while it ran"
# The decision of an attempt stopped on request (Ctrl-C, ``oomguard stop``, a service stop): not a failure.
STOPPED = "stopped by"
_PAGE = 5000
_BATCH_KEYS = ("micro_batch", "grad_accum", "global_batch", "world_size", "expandable_segments",
               "fallbacks_applied")


# --- reading the journal ----------------------------------------------------------------------


def _scan_events(journal: Journal) -> tuple[list[dict[str, Any]], dict[int, int], dict[int, float]]:
    """One pass over every event: the few the report lists (progress records are many and only
    summarised), the highest step each attempt reported, and each attempt's last activity."""
    kept: list[dict[str, Any]] = []
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
                if event["kind"] in ("worker_progress", "worker_checkpoint", "worker_step") and isinstance(step, int):
                    steps[attempt] = max(steps.get(attempt, step), step)
            if event["kind"] != "worker_progress":
                kept.append(event)
    return kept, steps, last_t


def stopped_by(sig: int) -> str:
    """The decision recorded for an attempt stopped on request, by the signal that asked."""
    return f"{STOPPED} {signal.Signals(sig).name}: a stop asked for, not a failure"


def closing_decision(stop: dict[str, Any] | None) -> str:
    """The decision for an attempt a later supervisor closes: the user's stop when one had been
    asked for (its ``stop_requested`` event's data), else interrupted."""
    return stopped_by(signal.Signals[stop["signal"]]) if stop else CLOSED_INTERRUPTED


def _user_stop(attempt: dict[str, Any]) -> bool:
    return ending_of_row(attempt) is Ending.STOPPED


def _decisions(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["attempt"]: e["data"] for e in events if e["kind"] == "decision" and e["attempt"] is not None}


# --- the run's span ---------------------------------------------------------------------------


def _span(meta: dict[str, Any], events: list[dict[str, Any]],
          attempts: list[dict[str, Any]]) -> tuple[float | None, float | None, float | None]:
    """(start, end, last activity): end is None while the run has not reached a terminal state."""
    times = [e["t"] for e in events] + [a["started"] for a in attempts]
    start = min(times) if times else meta.get("started")
    last = max([*times, *(a["ended"] for a in attempts if a["ended"]), meta.get("updated") or 0.0]) or None
    states = [e for e in events if e["kind"] == "state"]
    end = None
    if meta.get("state") in TERMINAL and states and states[-1]["data"].get("to") in TERMINAL:
        end = states[-1]["t"]
    return start, end, last


# --- failures, steps and time lost ------------------------------------------------------------


def _checkpoint_by_path(checkpoints: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["path"]: c for c in checkpoints}


def _writes(journal: Journal, checkpoints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every checkpoint write as first seen (path, mtime, step), with the file's bad mark; a journal
    from before writes were kept has only each file's newest write."""
    bad = {c["path"] for c in checkpoints if c["bad"]}
    writes = journal.checkpoint_writes() or [{"path": c["path"], "mtime": c["mtime"], "step": c["step"]}
                                             for c in checkpoints]
    return [{**w, "bad": w["path"] in bad} for w in writes]


def _written_during(writes: list[dict[str, Any]], start: float, end: float) -> list[dict[str, Any]]:
    """Good checkpoint writes made while the attempt ran, newest first."""
    return sorted((w for w in writes if not w["bad"] and start <= w["mtime"] <= end),
                  key=lambda w: w["mtime"], reverse=True)


def _last_step(attempt: dict[str, Any], reported: int | None, written: list[dict[str, Any]],
               resumed_step: int | None) -> tuple[int | None, str | None]:
    """The attempt's last step and where that figure comes from."""
    known = [s for s in (attempt["last_step"], reported) if s is not None]
    if known:
        return max(known), "progress"
    bounds = [c["step"] for c in written if c["step"] is not None]
    if resumed_step is not None:
        bounds.append(resumed_step)
    return (max(bounds), "checkpoint") if bounds else (None, None)


def _resume_point(nxt: dict[str, Any] | None, by_path: dict[str, dict[str, Any]],
                  writes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The checkpoint the next attempt started from: ``{"path", "step", "mtime"}`` of the write it
    found (not a later rewrite under the same name); step 0 with no path when it started over; None
    when there is no next attempt."""
    if nxt is None:
        return None
    if not nxt["checkpoint"]:
        return {"path": None, "step": 0, "mtime": None, "bad": False}
    known = by_path.get(nxt["checkpoint"], {})
    found = [w for w in writes if w["path"] == nxt["checkpoint"] and w["mtime"] <= nxt["started"]]
    if found:
        # That write's step, unknown when it was unknown: the file's step now may be a later write's.
        known = {**known, "step": found[-1]["step"], "mtime": found[-1]["mtime"]}
    return {"path": nxt["checkpoint"], "step": known.get("step"), "mtime": known.get("mtime"),
            "bad": bool(known.get("bad"))}


def _lost_seconds(start: float, end: float, resume: dict[str, Any] | None,
                  written: list[dict[str, Any]]) -> float:
    """Time after the checkpoint work continued from: the one the next attempt loaded if this attempt
    wrote it; with no next attempt, or when that checkpoint turned out bad, this attempt's newest
    good one; else the attempt's start (all of it is redone, as when the next attempt did not resume)."""
    anchor = start
    if resume is not None and resume.get("first_step") is not None:
        return max(0.0, end - start)
    if resume is not None and not resume["bad"] and resume["mtime"] is not None:
        if start <= resume["mtime"] <= end:
            anchor = resume["mtime"]
    elif written:
        anchor = written[0]["mtime"]
    return max(0.0, end - anchor)


def _failure(attempt: dict[str, Any], nxt: dict[str, Any] | None, ctx: dict[str, Any]) -> dict[str, Any]:
    n = attempt["attempt"]
    start = attempt["started"]
    # Closed later by the next supervisor: when that happened says nothing of when the attempt died.
    end = (None if _interrupted(attempt) else attempt["ended"]) or ctx["last_t"].get(n, start)
    written = _written_during(ctx["writes"], start, end)
    own = (_resume_point(attempt, ctx["by_path"], ctx["writes"]) or {}) if attempt["checkpoint"] else {}
    last_step, source = _last_step(attempt, ctx["steps"].get(n), written, own.get("step"))
    resume = _resume_point(nxt, ctx["by_path"], ctx["writes"])
    if resume is not None and resume["path"] and nxt is not None and nxt["attempt"] in ctx["resume_steps"]:
        resume["step"] = ctx["resume_steps"][nxt["attempt"]]
    # The next attempt was started from a checkpoint but showed an earlier first step: it redid
    # everything from that step on, whatever the checkpoint held.
    missed = ctx["not_resumed"].get(nxt["attempt"]) if nxt is not None else None
    redone_from = resume["step"] if resume is not None else None
    if resume is not None and missed is not None:
        resume["first_step"] = missed["first_step"]
        redone_from = missed["first_step"] - 1
    steps_lost = None
    if redone_from is not None and last_step is not None:
        steps_lost = max(0, last_step - redone_from)
    decision = ctx["decisions"].get(n)
    return {
        "attempt": n, "kind": attempt["kind"] or INTERRUPTED, "started": start, "ended": end,
        "micro_batch": attempt["micro_batch"], "grad_accum": attempt["grad_accum"],
        "peak_allocated": attempt.get("peak_allocated"),
        "exit_code": attempt["exit_code"], "signal": attempt["signal"],
        "exit": exit_text(attempt["exit_code"], attempt["signal"], attempt["returncode"]),
        "evidence": attempt["evidence"] or ("" if attempt["kind"] else "no exit recorded: the run was "
                                            "stopped or its supervisor ended during this attempt"),
        "decision": _decision_record(decision, attempt),
        "cause": ctx["causes"].get(n),
        "last_step": last_step, "last_step_source": source,
        "resumed_from": None if resume is None else {"path": resume["path"], "step": resume["step"],
                                                     **({"resumed": False, "first_step": missed["first_step"]}
                                                        if missed else {})},
        "steps_lost": steps_lost,
        "lost_s": _lost_seconds(start, end, resume, written),
        "gap_s": max(0.0, nxt["started"] - end) if nxt else 0.0,
    }


def _decision_record(decision: dict[str, Any] | None, attempt: dict[str, Any]) -> dict[str, Any] | None:
    if decision is None and not attempt["decision"]:
        return None
    decision = decision or {}
    return {"action": decision.get("action"), "reason": decision.get("reason", attempt["decision"]),
            "micro_batch": decision.get("micro_batch"), "grad_accum": decision.get("grad_accum")}


def _failures(attempts: list[dict[str, Any]], ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per attempt that failed, or was interrupted (its supervisor died, or no end was
    recorded, yet another attempt followed). The user's stop, a planned restart and ``--grow`` are
    no failures: the journal's ``ending`` column says which an attempt was."""
    out = []
    for i, attempt in enumerate(attempts):
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        ending = ending_of_row(attempt)
        if (ending is not None and ending.is_failure) or (
                nxt is not None and ending in (None, Ending.INTERRUPTED)):
            out.append(_failure(attempt, nxt, ctx))
    return out


def _restarts(attempts: list[dict[str, Any]], ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps redone after each attempt that ended without failing and was followed by another
    (a stop and a rerun, a restart asked for, a planned restart, --grow): counted like a failure's."""
    out = []
    for attempt, nxt in zip(attempts, attempts[1:], strict=False):
        ending = ending_of_row(attempt)
        if ending is None or ending.is_failure or ending is Ending.INTERRUPTED:
            continue  # counted among the failures
        figures = _failure(attempt, nxt, ctx)
        out.append({"attempt": attempt["attempt"], "ending": ending.value, "reason": attempt["decision"],
                    **{k: figures[k] for k in ("last_step", "last_step_source", "resumed_from", "steps_lost")}})
    return out


def ending_of_row(attempt: dict[str, Any]) -> Ending | None:
    """How a journaled attempt ended; None while it has no recorded end. Journals written before the
    ``ending`` column existed are read by what they did write (a kind means a failure)."""
    if attempt.get("ending"):
        return Ending(attempt["ending"])
    if attempt["ended"] is None:
        return None
    decision = str(attempt["decision"] or "")
    if attempt["kind"]:
        return Ending.HANG if attempt["kind"] == "hang" else Ending.FAILED
    if decision.startswith(INTERRUPTED):
        return Ending.INTERRUPTED
    if decision.startswith(STOPPED):
        return Ending.STOPPED
    if decision == "finished":
        return Ending.FINISHED
    return Ending.GROW if decision.startswith("grow") else Ending.PLANNED_RESTART


def _interrupted(attempt: dict[str, Any]) -> bool:
    return ending_of_row(attempt) is Ending.INTERRUPTED


# --- batch configuration over time --------------------------------------------------------------


def _batch_history(attempts: list[dict[str, Any]], events: list[dict[str, Any]],
                   decisions: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each change of the batch configuration: at an attempt's start (the supervisor's plan) or
    inside an attempt (the worker library changed it in-process), in time order."""
    entries = [{"t": a["started"], "attempt": a["attempt"], "by": "supervisor",
                "reason": _plan_reason(a, attempts[i - 1] if i else None, decisions),
                **{k: a[k] for k in _BATCH_KEYS}} for i, a in enumerate(attempts)]
    for event in events:
        if event["kind"] == "worker_batch":
            entries.append(_worker_batch_entry(event, attempts))
    entries.sort(key=lambda e: e["t"])
    history: list[dict[str, Any]] = []
    for entry in entries:
        entry["expandable_segments"] = bool(entry["expandable_segments"])
        if not history or any(history[-1][k] != entry[k] for k in _BATCH_KEYS):
            history.append(entry)
    return history


def _plan_reason(attempt: dict[str, Any], previous: dict[str, Any] | None,
                 decisions: dict[int, dict[str, Any]]) -> str:
    """Why the attempt ran with its plan: the decision after the attempt before it (a failure's,
    or a planned restart's such as --grow), else where the run started."""
    if previous is None:
        return "initial" if attempt["attempt"] == 1 else "continued"
    decision = decisions.get(previous["attempt"], {}).get("reason") or previous["decision"]
    return str(decision or "continued")


def _worker_batch_entry(event: dict[str, Any], attempts: list[dict[str, Any]]) -> dict[str, Any]:
    plan = next((a for a in attempts if a["attempt"] == event["attempt"]), attempts[-1] if attempts else {})
    data = event["data"]
    micro, accum = data.get("micro_batch"), data.get("grad_accum")
    world = plan.get("world_size", 1)
    return {"t": event["t"], "attempt": event["attempt"], "by": "worker", "reason": data.get("reason", ""),
            "micro_batch": micro, "grad_accum": accum,
            "global_batch": micro * accum * world if micro and accum else plan.get("global_batch"),
            "world_size": world, "expandable_segments": plan.get("expandable_segments", 0),
            "fallbacks_applied": plan.get("fallbacks_applied", 0)}


# --- checkpoints ------------------------------------------------------------------------------


def _checkpoint_summary(checkpoints: list[dict[str, Any]]) -> dict[str, Any]:
    good = [c for c in checkpoints if not c["bad"]]
    newest = good[0] if good else None
    return {
        "count": len(good),
        "newest": None if newest is None else {"path": newest["path"], "step": newest["step"],
                                               "mtime": newest["mtime"]},
        "bad": [{"path": c["path"], "step": c["step"], "reason": c["reason"]}
                for c in checkpoints if c["bad"]],
    }


# --- the report -------------------------------------------------------------------------------


def build_report(journal: Journal) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints and the dashboard shows)."""
    meta = journal.meta()
    attempts = journal.attempts()
    events, steps, last_t = _scan_events(journal)
    checkpoints = journal.checkpoints()
    decisions = _decisions(events)
    causes = {e["attempt"]: e["data"] for e in events if e["kind"] == "attribution" and e["attempt"] is not None}
    # The step each attempt resumed from, as known when it started: a checkpoint file that is
    # rewritten in place (nanoGPT's ckpt.pt) has a newer step in the checkpoints table by now.
    resume_steps = {e["attempt"]: e["data"]["step"] for e in events
                    if e["kind"] == "resume_point" and isinstance(e["data"].get("step"), int)}
    not_resumed = {e["attempt"]: e["data"] for e in events if e["kind"] == "not_resumed"}
    ctx = {"checkpoints": checkpoints, "by_path": _checkpoint_by_path(checkpoints), "steps": steps,
           "writes": _writes(journal, checkpoints),
           "last_t": last_t, "decisions": decisions, "causes": causes, "resume_steps": resume_steps,
           "not_resumed": not_resumed}
    failures = _failures(attempts, ctx)
    restarts = _restarts(attempts, ctx)
    redone = [*failures, *restarts]
    start, end, last = _span(meta, events, attempts)
    finish = end if end is not None else last
    total = finish - start if start is not None and finish is not None else 0.0
    lost = sum(f["lost_s"] + f["gap_s"] for f in failures)
    # Unknown: steps were seen but the resume point's step is not known. An attempt that showed no
    # step is no unknown: none was seen, so none is counted redone.
    unknown = [f for f in redone if f["steps_lost"] is None and f["resumed_from"] is not None
               and f["last_step"] is not None]
    return {
        "run_dir": meta.get("run_dir"), "state": meta.get("state", "starting"),
        "reason": meta.get("reason", ""),
        "finished": end is not None, "started": start, "ended": end, "last_activity": last,
        "total_s": total, "lost_s": min(lost, total) if total else lost, "attempts": len(attempts),
        "batch_history": _batch_history(attempts, events, decisions),
        "asked_global_batch": (meta.get("plan") or {}).get("asked_global"),  # None: the global batch was kept
        "failures": failures,
        "restarts": restarts,
        "steps_lost": sum(f["steps_lost"] or 0 for f in redone),
        "steps_lost_exact": not unknown and all(f["last_step_source"] != "checkpoint" for f in redone
                                                if f["steps_lost"] is not None),
        "steps_lost_unknown": len(unknown),
        "checkpoints": _checkpoint_summary(checkpoints),
        "progress": meta.get("progress"),
        "peaks": attempt_peaks(attempts),
        "planned_restarts": [{"attempt": a["attempt"], "reason": a["decision"], "cause": causes.get(a["attempt"])}
                             for a in attempts if ending_of_row(a) is Ending.PLANNED_RESTART
                             and a.get("stop_reason") != StopReason.RESTART.value],
        "stops": [{"attempt": a["attempt"], "at": a["ended"], "reason": a["decision"]}
                  for a in attempts if _user_stop(a)],
        "warnings": [{"attempt": e["attempt"], "kind": e["kind"], "message": e["data"].get("message", "")}
                     for e in events if e["kind"] in ("not_resumed", "checkpoint_glob_unmatched")],
    }


def read_report(run_dir: Path) -> dict[str, Any]:
    journal = open_existing(run_dir)
    try:
        return build_report(journal)
    finally:
        journal.close()


# --- text -------------------------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


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
    how = failure["exit"]
    lines = [f"  attempt {failure['attempt']} at {_clock(failure['ended'])}: {failure['kind']} "
             f"at micro-batch {failure['micro_batch']} × accum {failure['grad_accum']} ({how})",
             f"    evidence: {failure['evidence'] or '-'}"]
    if failure.get("cause"):
        lines.append(f"    cause:    {failure['cause']['summary']}")
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
    lines = [text]
    lines += [f"  bad: {b['path']}: {b['reason'] or 'failed to load'}" for b in summary["bad"]]
    return lines


def format_report(report: dict[str, Any]) -> str:
    lines = _header(report)
    lines.append("batch configuration over time:")
    asked = report.get("asked_global_batch")
    if asked is not None:
        lines.append(f"  the script takes no accumulation: its global batch is micro × world (asked {asked})")
    for entry in report["batch_history"]:
        who = "" if entry["by"] == "supervisor" else f" (in-process by the worker: {entry['reason']})"
        why = f" — {entry['reason']}" if entry["by"] == "supervisor" and entry["reason"] else ""
        lines.append(f"  {_clock(entry['t'])} attempt {entry['attempt']}: {_batch_text(entry, asked)}{who}{why}")
    lines.append("failures:" if report["failures"] else "failures:    none")
    for failure in report["failures"]:
        lines += _failure_lines(failure)
    if report.get("planned_restarts"):
        count = len(report["planned_restarts"])
        lines.append(f"planned restarts (before the limit, right after a checkpoint): {count}")
        for r in report["planned_restarts"]:
            lines.append(f"  attempt {r['attempt']}: {r['reason']}")
            if r["cause"]:
                lines.append(f"    cause:    {r['cause']['summary']}")
    for stop in report.get("stops") or []:
        lines.append(f"stopped:     attempt {stop['attempt']} at {_clock(stop['at'])}, {stop['reason']}")
    redone = [r for r in report.get("restarts") or [] if r["steps_lost"] or r["steps_lost"] is None]
    if redone:
        lines.append("redone after restarts that were no failure (counted in steps lost):")
        lines += [f"  attempt {r['attempt']} ({r['ending']}): {_steps_text(r)}" for r in redone]
    for warning in report.get("warnings") or []:
        lines.append(f"warning:     attempt {warning['attempt']}: {warning['message']}")
    lines += _checkpoint_lines(report["checkpoints"])
    if any(p.get("peak_allocated") for p in report.get("peaks") or []):
        lines.append("memory per attempt (allocated: the allocator's highest step peak, from the probe):")
        lines += [f"  {peak_text(p)}" for p in report["peaks"]]
    if report["progress"]:
        lines.append(f"last progress: {progress_text(report['progress'])}")
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------


def _cmd_report(args: argparse.Namespace, command: Sequence[str]) -> int:
    if command:
        raise UsageError("report", "takes no command after --",
                         f"run: oomguard report --run-dir {shlex.quote(str(args.run_dir))}")
    report = read_report(Path(args.run_dir))
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else format_report(report))
    return 0


def add_report_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("report", help="summarise a run: time lost, failures, batch, checkpoints")
    parser.add_argument("--run-dir", default="oomguard-run", help="the run directory (default: oomguard-run)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=_cmd_report)
