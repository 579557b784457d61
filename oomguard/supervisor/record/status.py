"""The status document: what ``oomguard status --json``, the API and the dashboard all show.

Tested in tests/unit/supervisor/run/test_preflight.py, tests/unit/probe/test_steps.py, tests/e2e/.

Built from the journal alone, so it works whether or not the supervisor is still running.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oomguard.supervisor.lifecycle import exit_text
from oomguard.supervisor.record import memoryparts
from oomguard.supervisor.record.journal import Journal, open_existing
from oomguard.supervisor.record.picture import (
    Attempt,
    RunPicture,
    attempt_peaks,
    by_world,
    read_picture,
    supervisor_alive,
)
from oomguard.supervisor.record.reporttext import peak_text, progress_text, worlds_text
from oomguard.supervisor.units import format_size

__all__ = ["FailureRecord", "StatusDoc", "format_status", "read_status", "status_document", "status_of",
           "supervisor_alive"]

@dataclass(frozen=True)
class FailureRecord:
    """One failed attempt as status shows it."""

    attempt: int
    kind: str
    micro_batch: int
    grad_accum: int | None
    exit_code: int | None
    signal: int | None
    evidence: str | None
    decision: str | None
    started: float | None
    ended: float | None
    checkpoint: str | None
    peak_allocated: int | None  # the allocator's highest step peak (probe)
    exit: str | None  # how its process ended, in the words status, the report and the dashboard share
    cause: dict[str, Any] | None  # a memory failure's cause (decide/attribution.py) and the figures that decided it
    # what held memory at the failure, one per rank (memoryparts.MemoryBreakdown.as_dict)
    breakdowns: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, attempt: Attempt, cause: Mapping[str, Any] | None) -> FailureRecord:
        return cls(attempt=attempt.number, kind=attempt.kind or (attempt.ending.value if attempt.ending else ""),
                   micro_batch=attempt.micro_batch, grad_accum=attempt.grad_accum, exit_code=attempt.exit_code,
                   signal=attempt.signal, evidence=attempt.evidence, decision=attempt.decision,
                   started=attempt.started, ended=attempt.ended, checkpoint=attempt.checkpoint,
                   peak_allocated=attempt.peak_allocated, exit=attempt.exit,
                   cause=None if cause is None else dict(cause),
                   breakdowns=[b.as_dict() for b in attempt.breakdowns])


@dataclass(frozen=True)
class StatusDoc:
    """The status document (``oomguard status --json``, /api/status, the pages' live status): its one
    schema; the API's model is this class (web/app.py)."""

    state: str
    reason: str
    supervisor_alive: bool
    supervisor_pid: int | None
    run_dir: str | None
    command: list[str] | None
    attempt: int
    micro_batch: int | None
    grad_accum: int | None
    global_batch: int | None
    asked_global_batch: int | None  # above global_batch once a script without accumulation was shrunk
    accumulates: bool  # False: the script takes no accumulation (global batch = micro × world)
    world_size: int | None
    expandable_segments: bool
    fallbacks_applied: int
    alloc_conf: dict[str, str]  # PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF as the worker got them
    worker_pid: int | None  # the training process (the launcher's child), not oomguard's launch.py
    rank_pids: dict[str, int]  # under torchrun or accelerate: each rank's training process, by rank
    checkpoint: str | None  # the checkpoint the current attempt started from
    newest_checkpoint: dict[str, Any] | None  # the newest good one: /api/checkpoints' row
    progress: dict[str, Any] | None  # with the probe: steps_per_s, allocated_peak, limit_bytes
    peaks: list[dict[str, Any]]  # per attempt: peak_allocated (probe), peak_gpu (NVML), peak_rss
    memory: dict[str, Any] | None  # the newest memory sample
    started: float | None
    updated: float | None
    failures: list[FailureRecord]
    forecast: dict[str, Any] | None  # when the memory trend reaches the limit, while the supervisor runs
    liveness: dict[str, Any] | None  # why a silent worker is held alive, while it is
    degraded: list[dict[str, Any]]  # oomguard's own parts that are failing (the run goes on)
    probe: dict[str, Any] | None  # the in-process probe: loaded, failed, off, or none seen and why
    own_failures: list[dict[str, Any]]  # oomguard's probe or spare that failed an attempt, off since
    spare: dict[str, Any] | None  # why no spare interpreter is held (said once a run), or none
    warnings: list[dict[str, Any]]  # said once each: an attempt that did not resume, a glob that matches nothing
    resume_command: str | None  # after a stop: the command that resumes the run
    # what filled memory, one bar per attempt and moment (record/memoryparts.py; the dashboard's bars)
    memory_breakdown: list[dict[str, Any]] = field(default_factory=list)
    # time at each world size (an elastic run that lost a node: record/picture.py's by_world)
    worlds: list[dict[str, Any]] = field(default_factory=list)


def status_document(journal: Journal) -> dict[str, Any]:
    """The status document as plain data (what ``--json`` prints)."""
    return asdict(status_of(read_picture(journal)))


def status_of(run: RunPicture) -> StatusDoc:
    """The picture of the run as status, the API and the pages give it."""
    alive, meta, plan, current = run.supervisor.alive, run.meta, run.plan, run.current
    good = run.good_checkpoints
    return StatusDoc(
        state=run.state, reason=run.reason, supervisor_alive=alive, supervisor_pid=run.supervisor.pid,
        run_dir=run.run_dir, command=None if run.command is None else list(run.command), attempt=run.attempt,
        micro_batch=plan.micro_batch, grad_accum=plan.grad_accum, global_batch=plan.global_batch,
        asked_global_batch=plan.asked_global or plan.global_batch, accumulates=plan.asked_global is None,
        world_size=plan.world_size, expandable_segments=plan.expandable_segments,
        fallbacks_applied=plan.fallbacks_applied, alloc_conf=dict(meta.get("alloc_conf") or {}),
        worker_pid=meta.get("worker_pid") if alive else None,
        rank_pids=dict(meta.get("rank_pids") or {}) if alive else {},
        checkpoint=current.checkpoint if current else None, newest_checkpoint=good[0].row() if good else None,
        progress=current_progress(dict(run.progress) if run.progress is not None else None,
                                  _current_row(current), run.resume_points),
        peaks=attempt_peaks(run.attempts),
        memory=None if run.latest_sample is None else dict(run.latest_sample),
        started=run.started, updated=run.updated,
        failures=[FailureRecord.of(a, run.causes.get(a.number)) for a in run.failures],
        forecast=meta.get("forecast") if alive else None, liveness=_liveness(meta, alive),
        degraded=list(meta.get("degraded") or []) if alive else [], probe=meta.get("probe"),
        own_failures=[dict(own) for own in run.own_failures], spare=meta.get("spare"),
        warnings=list(meta.get("warnings") or []),
        resume_command=meta.get("resume_command") if run.state == "stopped" and not alive else None,
        memory_breakdown=[b.as_dict() for b in memoryparts.per_attempt(run.breakdowns)],
        worlds=by_world(run.attempts, time.time() if alive else None))


def _current_row(current: Attempt | None) -> dict[str, Any]:
    if current is None:
        return {}
    return {"attempt": current.number, "started": current.started, "checkpoint": current.checkpoint}


def current_progress(progress: dict[str, Any] | None, current: dict[str, Any],
                     resume_points: Mapping[int, Mapping[str, Any]]) -> dict[str, Any] | None:
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


def _liveness(meta: Mapping[str, Any], alive: bool) -> dict[str, Any] | None:
    """Why a silent worker is held alive (``silent 42 min; busy: 97% of a core``), while it is: the
    note of the running attempt, from a supervisor that is still there."""
    note = meta.get("liveness")
    if not alive or not note or meta.get("state") != "running" or note.get("attempt") != meta.get("attempt"):
        return None
    return dict(note)


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
    if (worlds := worlds_text(doc.get("worlds") or [])) is not None:
        lines.append(f"worlds:     {worlds}")
    if doc.get("alloc_conf"):
        lines.append("allocator:  " + ", ".join(f"{k}={v}" for k, v in doc["alloc_conf"].items()))
    if doc["progress"]:
        lines.append(f"progress:   {progress_text(doc['progress'])}")
    if any(p.get("peak_allocated") for p in doc.get("peaks") or []):
        lines += [f"peaks:      {peak_text(p)}" for p in doc["peaks"]]
    return "\n".join(lines + _memory_lines(doc) + _note_lines(doc) + _failure_lines(doc))


def _memory_lines(doc: dict[str, Any]) -> list[str]:
    memory, lines = doc.get("memory") or {}, []
    if memory.get("worker_rss_bytes") is not None:
        lines.append(f"memory:     worker RSS {format_size(memory['worker_rss_bytes'])}"
                     + (f", GPU {format_size(memory['gpu_worker_bytes'])}" if memory.get("gpu_worker_bytes") else ""))
    if memory.get("gpu_unavailable"):
        lines.append(f"gpu:        {memory['gpu_unavailable']}")
    return lines


def _note_lines(doc: dict[str, Any]) -> list[str]:
    """oomguard's own parts (the probe, the spares, what is degraded), the forecast, the warnings."""
    lines = [f"probe:      {probe_text(doc['probe'])}"] if doc.get("probe") else []
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
    return lines


def _failure_lines(doc: dict[str, Any]) -> list[str]:
    lines = [f"memory:     {text}" for text in memoryparts.status_lines(doc.get("memory_breakdown") or [])]
    for f in doc["failures"]:
        how = f.get("exit") or exit_text(f["exit_code"], f["signal"])
        lines.append(f"  attempt {f['attempt']}: {f['kind']} at micro-batch {f['micro_batch']} ({how}): "
                     f"{f['evidence']}")
        if f.get("cause"):
            lines.append(f"    cause: {f['cause']['summary']}")
    return lines


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
