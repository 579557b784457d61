"""The status document: what ``oomguard status --json``, the API and the dashboard all show.

Built from the journal alone, so it works whether or not the supervisor is still running.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

from oomguard.supervisor.lifecycle.states import exit_text
from oomguard.supervisor.record.figures import attempt_peaks, peak_text, progress_text
from oomguard.supervisor.record.journal import Journal, open_existing
from oomguard.supervisor.units import format_size


def supervisor_alive(meta: dict[str, Any]) -> bool:
    """Is the supervisor that wrote this journal still running? (pid and start time must match, so a
    reused pid is not mistaken for it)."""
    pid, started = meta.get("supervisor_pid"), meta.get("supervisor_started")
    if not pid or started is None:
        return False
    try:
        proc = psutil.Process(pid)
        # A killed supervisor nobody has reaped yet is a zombie: its pid and start time still match.
        return abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def failure_records(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**{key: row[key] for key in ("attempt", "kind", "micro_batch", "grad_accum", "exit_code", "signal",
                                          "evidence", "decision", "started", "ended", "checkpoint")},
             "peak_allocated": row.get("peak_allocated"),
             "exit": exit_text(row["exit_code"], row["signal"], row["returncode"])}
            for row in attempts if row["kind"]]


def status_document(journal: Journal) -> dict[str, Any]:
    meta = journal.meta()
    attempts = journal.attempts()
    plan = meta.get("plan") or {}
    config = meta.get("config") or {}
    alive = supervisor_alive(meta)
    current = attempts[-1] if attempts else {}
    checkpoints = [c for c in journal.checkpoints() if not c["bad"]]
    return {
        "state": meta.get("state", "starting"),
        "reason": meta.get("reason", ""),
        "supervisor_alive": alive,
        "supervisor_pid": meta.get("supervisor_pid"),
        "run_dir": meta.get("run_dir"),
        "command": config.get("command"),
        "attempt": meta.get("attempt", 0),
        "micro_batch": plan.get("micro_batch", config.get("micro_batch")),
        "grad_accum": plan.get("grad_accum"),
        "global_batch": plan.get("global_batch"),
        # the global batch asked for: above global_batch once a script that cannot accumulate was shrunk
        "asked_global_batch": plan.get("asked_global") or plan.get("global_batch"),
        "accumulates": plan.get("asked_global") is None,
        "world_size": plan.get("world_size", config.get("world_size")),
        "expandable_segments": plan.get("expandable_segments", False),
        "fallbacks_applied": plan.get("fallbacks_applied", 0),
        "alloc_conf": meta.get("alloc_conf") or {},  # the allocator variables the worker got
        "worker_pid": meta.get("worker_pid") if alive else None,  # the training process, not the launcher
        "rank_pids": (meta.get("rank_pids") or {}) if alive else {},  # under torchrun/accelerate: rank -> pid
        "checkpoint": current.get("checkpoint"),
        "newest_checkpoint": checkpoints[0] if checkpoints else None,
        "progress": current_progress(meta.get("progress"), current, journal.event_data("resume_point")),
        "peaks": attempt_peaks(attempts),  # per attempt: the allocator's step peak (probe), NVML's, the RSS
        "memory": latest[-1] if (latest := journal.latest_samples(1)) else None,
        "started": meta.get("started"),
        "updated": meta.get("updated"),
        "failures": _with_causes(failure_records(attempts), journal.event_data("attribution")),
        "forecast": meta.get("forecast") if alive else None,
        "liveness": _liveness(meta, alive),
        "degraded": (meta.get("degraded") or []) if alive else [],
        "probe": meta.get("probe"),  # the in-process probe: loaded, failed, off, or none seen and why
        # oomguard's own additions that failed an attempt, each off for the attempts after (decide/classify.py)
        "own_failures": [{"attempt": n, **data} for n, data in journal.event_data("own_failure").items()],
        "spare": meta.get("spare"),  # why no spare interpreter is held (run/spare.py), said once a run
        "warnings": meta.get("warnings") or [],  # a resume that did not happen, a glob that matches nothing
        # after a stop: the command that resumes the run (the same line, in the same directory)
        "resume_command": meta.get("resume_command") if meta.get("state") == "stopped" and not alive else None,
    }


def current_progress(progress: dict[str, Any] | None, current: dict[str, Any],
                     resume_points: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The progress of the newest attempt. Until it reports a step, the journal's progress is the
    previous attempt's, whose step the new one went back from: the step it resumed from (its
    ``resume_point``) is where it stands, and nothing when it started over or that step is unknown."""
    if not current or progress is None:
        return progress
    attempt = progress.get("attempt")
    if attempt == current["attempt"] or (attempt is None and (progress.get("t") or 0) >= current["started"]):
        return progress
    point = resume_points.get(current["attempt"]) or {}
    if not current.get("checkpoint") or not isinstance(point.get("step"), int):
        return None
    return {"step": point["step"], "total_steps": progress.get("total_steps"), "t": current["started"],
            "source": "resume_point", "checkpoint": current["checkpoint"], "attempt": current["attempt"]}


def _pid_text(doc: dict[str, Any]) -> str:
    """``4242 (python)``; under a launcher each rank's: ``4242 (torchrun); ranks 0: 4250, 1: 4251``."""
    pid = doc.get("worker_pid")
    if not pid:
        return "-"
    ranks = doc.get("rank_pids") or {}
    name = _process_name(pid)
    text = f"{pid}" + (f" ({name})" if name else "")
    if ranks:
        text += "; ranks " + ", ".join(f"{rank}: {p}" for rank, p in ranks.items())
    return text


def _process_name(pid: int) -> str | None:
    """The process's name as ps shows it, where it can be read (status on the same machine)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or None
    except OSError:
        return None


def _liveness(meta: dict[str, Any], alive: bool) -> dict[str, Any] | None:
    """Why a silent worker is held alive (``silent 42 min; busy: 97% of a core``), while it is: the
    note of the running attempt, from a supervisor that is still there."""
    note = meta.get("liveness")
    if not alive or not note or meta.get("state") != "running" or note.get("attempt") != meta.get("attempt"):
        return None
    return dict(note)


def _with_causes(failures: list[dict[str, Any]], causes: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each memory failure's cause (attribution.py) with the figures that decided it."""
    return [{**f, "cause": causes.get(f["attempt"])} for f in failures]


def read_status(run_dir: Path) -> dict[str, Any]:
    journal = open_existing(run_dir)
    try:
        return status_document(journal)
    finally:
        journal.close()


def format_status(doc: dict[str, Any]) -> str:
    lines = [
        f"state:      {doc['state']}" + ("" if doc["supervisor_alive"] or doc["state"] in
                                          ("succeeded", "failed", "stopped") else " (supervisor not running)"),
        f"reason:     {doc['reason']}",
        f"attempt:    {doc['attempt']}",
        f"batch:      micro {doc['micro_batch']} × accum {doc['grad_accum']} × world {doc['world_size']}"
        f" = {global_text(doc)}",
        f"worker pid: {_pid_text(doc)}",
        f"checkpoint: {_checkpoint_text(doc)}",
    ]
    if doc.get("alloc_conf"):
        lines.append("allocator:  " + ", ".join(f"{k}={v}" for k, v in doc["alloc_conf"].items()))
    if doc["progress"]:
        lines.append(f"progress:   {progress_text(doc['progress'])}")
    if any(p.get("peak_allocated") for p in doc.get("peaks") or []):
        lines += [f"peaks:      {peak_text(p)}" for p in doc["peaks"]]
    memory = doc.get("memory") or {}
    if memory.get("worker_rss_bytes") is not None:
        lines.append(f"memory:     worker RSS {format_size(memory['worker_rss_bytes'])}"
                     + (f", GPU {format_size(memory['gpu_worker_bytes'])}" if memory.get("gpu_worker_bytes") else ""))
    if memory.get("gpu_unavailable"):
        lines.append(f"gpu:        {memory['gpu_unavailable']}")
    if doc.get("probe"):
        lines.append(f"probe:      {probe_text(doc['probe'])}")
    # The probe's line above says its own (its state is off, and why); the spares' are these two.
    lines += [f"spares:     {own['off']}" for own in doc.get("own_failures") or [] if own.get("addition") == "spare"]
    if doc.get("spare"):
        lines.append(f"spares:     {doc['spare']['state']}: {doc['spare']['why']}")
    if doc.get("forecast"):
        lines.append(f"forecast:   {doc['forecast']['text']}")
    if doc.get("liveness"):
        lines.append(f"liveness:   {doc['liveness']['text']} (not a hang)")
    for problem in doc.get("degraded") or []:
        lines.append(f"degraded:   {problem['component']}: {problem['message']} "
                     f"({problem['lost']} {problem.get('unit', '')} lost so far)")
    for warning in doc.get("warnings") or []:
        lines.append(f"warning:    attempt {warning['attempt']}: {warning['message']}")
    if doc.get("resume_command"):
        lines.append(f"resume:     {doc['resume_command']}")
    for f in doc["failures"]:
        how = f.get("exit") or exit_text(f["exit_code"], f["signal"])
        lines.append(f"  attempt {f['attempt']}: {f['kind']} at micro-batch {f['micro_batch']} ({how}): "
                     f"{f['evidence']}")
        if f.get("cause"):
            lines.append(f"    cause: {f['cause']['summary']}")
    return "\n".join(lines)


def probe_text(probe: dict[str, Any]) -> str:
    """Whether the probe is in the worker: loaded in N processes, failed and why, off, or none seen and why."""
    state, failures = probe.get("state"), probe.get("failures") or []
    if state == "loaded":
        count = probe.get("processes", 0)
        text = f"loaded in {count} process{'es' if count != 1 else ''}"
        if probe.get("ranks"):
            text += " (ranks " + ", ".join(str(rank) for rank in probe["ranks"]) + ")"
        partial = probe.get("partial") or []
        if partial:
            text += f"; not done in {len(partial)}: {partial[0]['detail']}"
        return text + (f"; a part failed in {len(failures)}: {failures[0]['detail']}" if failures else "")
    if state == "failed":
        return f"failed to load: {probe.get('why')} (the run goes on without it)"
    if state == "off":
        return f"none: {probe.get('why')}"
    return f"none seen: {probe.get('why')}"


def global_text(doc: dict[str, Any]) -> str:
    """The real global batch, and the one asked for when it is smaller (a script without accumulation)."""
    real, asked = doc.get("global_batch"), doc.get("asked_global_batch")
    return f"{real} (asked {asked})" if asked is not None and asked != real else str(real)


def _checkpoint_text(doc: dict[str, Any]) -> str:
    """The newest good checkpoint and its step; the one the attempt started from when different."""
    newest = doc.get("newest_checkpoint")
    started = doc.get("checkpoint")
    if not newest:
        return started or "-"
    text = newest["path"] + (f" (step {newest['step']})" if newest.get("step") is not None else "")
    return text + (f"; attempt started from {started}" if started and started != newest["path"] else "")
