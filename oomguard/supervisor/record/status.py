"""The status document (what ``oomguard status --json``, the API and the dashboard all show), and
the runs on a machine found by their journals (what ``oomguard ls`` and the many-runs page list).

Tested in tests/unit/supervisor/record/test_status.py, tests/unit/supervisor/run/test_preflight.py,
tests/unit/probe/test_steps.py, tests/e2e/.

Built from the journal alone (its picture, ``picture.read_picture``), so a finished run, a run whose
supervisor was killed and a running one read the same way and no run's server has to be up. A
journal that cannot be read is listed by ``ls`` with the reason ``journal.check`` found, never a
traceback and never the end of the listing.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from oomguard.supervisor.lifecycle import UsageError, exit_text
from oomguard.supervisor.record import memoryparts
from oomguard.supervisor.record.journal import JOURNAL_NAME, Journal, open_existing
from oomguard.supervisor.record.picture import (
    TERMINAL,
    Attempt,
    RunPicture,
    attempt_peaks,
    by_world,
    plain,
    read_picture,
)
from oomguard.supervisor.record.picture import supervisor_alive as supervisor_alive  # status's, for web/client.py
from oomguard.supervisor.record.report import peak_text, progress_text, worlds_text
from oomguard.supervisor.units import format_size


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
        same = {f.name: getattr(attempt, f.name) for f in fields(cls)[2:-2]}  # micro_batch to exit: the attempt's
        return cls(attempt=attempt.number, kind=attempt.kind or (attempt.ending.value if attempt.ending else ""),
                   cause=plain(cause), breakdowns=[b.as_dict() for b in attempt.breakdowns],
                   **same)


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
    good = [c for c in run.checkpoints if not c.bad]
    row = {"attempt": current.number, "started": current.started, "checkpoint": current.checkpoint} if current else {}
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
        progress=current_progress(plain(run.progress), row, run.resume_points),
        peaks=attempt_peaks(run.attempts),
        memory=plain(run.latest_sample),
        started=run.started, updated=run.updated,
        failures=[FailureRecord.of(a, run.causes.get(a.number)) for a in run.failures],
        forecast=meta.get("forecast") if alive else None, liveness=_liveness(meta, alive),
        degraded=list(meta.get("degraded") or []) if alive else [], probe=meta.get("probe"),
        own_failures=[dict(own) for own in run.own_failures], spare=meta.get("spare"),
        warnings=list(meta.get("warnings") or []),
        resume_command=meta.get("resume_command") if run.state == "stopped" and not alive else None,
        memory_breakdown=[b.as_dict() for b in memoryparts.per_attempt(run.breakdowns)],
        worlds=by_world(run.attempts, time.time() if alive else None))


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
    try:  # the process's name as ps shows it, where it can be read (status on the same machine)
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        name = ""
    text = f"{pid}" + (f" ({name})" if name else "")
    if ranks := doc.get("rank_pids"):
        text += "; ranks " + ", ".join(f"{rank}: {p}" for rank, p in ranks.items())
    return text


def _liveness(meta: Mapping[str, Any], alive: bool) -> dict[str, Any] | None:
    """Why a silent worker is held alive (``silent 42 min; busy: 97% of a core``), while it is: the
    note of the running attempt, from a supervisor that is still there."""
    note = meta.get("liveness")
    if not alive or not note or meta.get("state") != "running" or note.get("attempt") != meta.get("attempt"):
        return None
    return dict(note)


def read_status(run_dir: Path) -> dict[str, Any]:
    with closing(open_existing(run_dir)) as journal:
        return status_document(journal)


def format_status(doc: dict[str, Any]) -> str:
    lines = [
        f"state:      {doc['state']}"
        + ("" if doc["supervisor_alive"] or doc["state"] in TERMINAL else " (supervisor not running)"),
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
    lines += [f"degraded:   {p['component']}: {p['message']} ({p['lost']} {p.get('unit', '')} lost so far)"
              for p in doc.get("degraded") or []]
    lines += [f"warning:    attempt {w['attempt']}: {w['message']}" for w in doc.get("warnings") or []]
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
        if partial := probe.get("partial"):
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


# --- the runs on a machine: ``oomguard ls`` ---------------------------------------------

MAX_DEPTH = 4  # directories below each root that are searched: runs/<project>/<experiment>/<run> and no deeper
# Never runs, often huge: walking them would make ``ls`` slow for nothing.
SKIP = frozenset({"node_modules", "__pycache__", "site-packages", "venv", "wandb", "mlruns"})

# The supervisor column: is the process that wrote the journal still there?
ALIVE, EXITED, GONE = "alive", "exited", "gone"  # gone: killed before it could record an ending
DAMAGED = "damaged"  # the state of a run whose journal cannot be read


def find_runs(roots: Sequence[Path], max_depth: int = MAX_DEPTH) -> list[Path]:
    """Every run directory (one holding a journal) at or below each root, each once, sorted."""
    return sorted({run_dir for root in roots for run_dir in _walk(Path(root).resolve(), max_depth)})


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
        if not entry.name.startswith(".") and entry.name not in SKIP and entry.is_dir(follow_symlinks=False):
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
    except sqlite3.DatabaseError as exc:
        if str(exc).startswith("no such table"):  # journal.check let it through: a supervisor is creating it
            return {**_unreadable(run_dir, "the journal is being created"), "state": "starting"}
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
            _progress(row, now), f"alive (pid {row['supervisor_pid']})" if row["supervisor"] == ALIVE
            else row["supervisor"] or "-", row["dashboard"] or "-", _why(row))


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
