"""The morning report as text (what ``oomguard report`` prints; ``report.py`` builds the document),
and how status and the report state a run's progress, memory and worlds: one wording for both.

Tested in tests/unit/supervisor/record/test_report.py and tests/unit/supervisor/observe/test_progress.py.

The progress comes from the journal's ``progress`` meta (``observe.progress``): with the in-process
probe, real optimizer steps, steps per second (timed inside the worker), the ETA where a total is
known, the allocator's peak and its limit; without it, the worker library's records or the steps
read from the output. Each attempt's peaks come from its journal row: the allocator's highest
per-step peak (``peak_allocated``, the probe's), NVML's GPU figure and the worker tree's RSS.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from oomguard.supervisor.record import memoryparts
from oomguard.supervisor.units import format_size


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
    how = failure["exit"]
    lines = [f"  attempt {failure['attempt']} at {_clock(failure['ended'])}: {failure['kind']} "
             f"at micro-batch {failure['micro_batch']} × accum {failure['grad_accum']} ({how})",
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
    if (worlds := worlds_text(report.get("worlds") or [])) is not None:
        lines.append(f"time at each world size: {worlds}")
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
