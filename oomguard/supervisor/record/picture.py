"""One typed picture of a run, read from its journal: what status, the report, ``oomguard ls``, the
API and the dashboard all render.

Everything here comes from the journal's columns and its events' data, never from the words the
supervisor wrote for people (a decision's reason is shown as written, never read back). A journal
written before a structured field existed is brought up to date once, as it is read (``ending_of``:
the one place that reads the words a supervisor wrote, once per row). ``read_picture`` is cheap
enough for every status poll; the report's full history (every event, every checkpoint write) is
``record/report.py``'s.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import psutil

from oomguard.supervisor.lifecycle import Ending, StopReason, exit_text
from oomguard.supervisor.record import memoryparts
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.memoryparts import MemoryBreakdown

TERMINAL = ("succeeded", "failed", "stopped")

Data = Mapping[str, Any]  # an event's data or a meta value, as the journal holds it

# The decision recorded when an attempt ends without a failure verdict. The loop writes these; the
# reading side reads the ``ending`` and ``stop_reason`` columns, and these words only in ``ending_of``,
# for journals from before those columns.
INTERRUPTED = Ending.INTERRUPTED.value  # an attempt that ended without a recorded exit (its supervisor died)
# The decision a restarted supervisor writes for an attempt its killed predecessor left open.
CLOSED_INTERRUPTED = f"{INTERRUPTED}: its supervisor ended while it ran"
# The decision of an attempt stopped on request (Ctrl-C, ``oomguard stop``, a service stop): not a failure.
STOPPED = "stopped by"
_FINISHED = "finished"
_GROW = "grow"


@dataclass(frozen=True)
class Closing:
    """How an attempt left open is closed: its ending, why it was stopped, and the words recorded."""

    ending: Ending
    stop_reason: StopReason | None
    decision: str


def stopped_by(sig: int) -> str:
    """The decision recorded for an attempt stopped on request, by the signal that asked."""
    return f"{STOPPED} {signal.Signals(sig).name}: a stop asked for, not a failure"


def closing(stop: Mapping[str, Any] | None) -> Closing:
    """The closing of an attempt a later supervisor finds open: the user's stop when one had been
    asked for (its ``stop_requested`` event's data), else interrupted."""
    if stop:
        return Closing(Ending.STOPPED, StopReason.USER, stopped_by(signal.Signals[stop["signal"]]))
    return Closing(Ending.INTERRUPTED, None, CLOSED_INTERRUPTED)


def ending_of(row: Mapping[str, Any]) -> Ending | None:
    """How a journaled attempt ended; None while it has no recorded end."""
    if row.get("ending"):
        return Ending(row["ending"])
    if row["ended"] is None:
        return None
    # A row written before the ``ending`` column: a kind means a failure; else the decision's words.
    kind, decision = row["kind"], str(row["decision"] or "")
    if kind:
        return Ending.HANG if kind == "hang" else Ending.FAILED
    if decision.startswith(INTERRUPTED):
        return Ending.INTERRUPTED
    if decision.startswith(STOPPED):
        return Ending.STOPPED
    if decision == _FINISHED:
        return Ending.FINISHED
    return Ending.GROW if decision.startswith(_GROW) else Ending.PLANNED_RESTART


@dataclass(frozen=True)
class Attempt:
    """One attempt: the plan it ran with, how it ended, its peaks, and what was decided after it."""

    number: int
    started: float
    ended: float | None
    pid: int | None
    micro_batch: int
    grad_accum: int
    global_batch: int
    world_size: int
    checkpoint: str | None  # the checkpoint it started from
    command: tuple[str, ...]
    log_path: str
    expandable_segments: bool
    fallbacks_applied: int
    returncode: int | None
    exit_code: int | None
    signal: int | None
    kind: str | None  # the failure kind (classify.py), for a failure
    evidence: str | None
    decision: str | None  # what was done after it, in the words written then: shown, never parsed
    last_step: int | None
    peak_rss: int | None
    peak_gpu: int | None
    ending: Ending | None  # None while it runs
    stop_reason: str | None
    peak_allocated: int | None
    breakdowns: tuple[MemoryBreakdown, ...] = ()  # memory_breakdown events, one per rank per failure

    @property
    def failed(self) -> bool:
        """The one definition of a failure: the attempt ended failing, hanging, or by a lost peer."""
        return self.ending is not None and self.ending.is_failure

    @property
    def exit(self) -> str:
        """How its process ended (``exit 1``, ``signal 9 (SIGKILL)``), as everything says it."""
        return exit_text(self.exit_code, self.signal, self.returncode)

    def row(self) -> dict[str, Any]:
        """The journal row's shape (its columns in order), with the ending migrated: what the API's
        attempts list gives."""
        columns = {f.name: getattr(self, f.name) for f in fields(self)[1:-1]}  # not number, breakdowns
        return {"attempt": self.number, **columns, "command": list(self.command),
                "expandable_segments": int(self.expandable_segments),
                "ending": None if self.ending is None else self.ending.value}

    @classmethod
    def of(cls, row: Data, breakdowns: tuple[MemoryBreakdown, ...] = ()) -> Attempt:
        """From a journal row; one written before a column existed lacks it (None)."""
        columns: dict[str, Any] = {f.name: row.get(f.name) for f in fields(cls)[1:-1]}
        columns.update(command=tuple(row["command"]), expandable_segments=bool(row["expandable_segments"]),
                       ending=ending_of(row))
        return cls(number=row["attempt"], breakdowns=breakdowns, **columns)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint file as last seen: its newest write's step, and whether it failed to load."""

    path: str
    step: int | None
    mtime: float
    first_seen: float
    attempt: int | None
    bad: bool
    reason: str | None

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "bad": int(self.bad)}


@dataclass(frozen=True)
class Plan:
    """The batch plan the run is at now (the journal's ``plan``)."""

    micro_batch: int | None
    grad_accum: int | None
    global_batch: int | None
    asked_global: int | None  # set once a script that takes no accumulation was shrunk
    world_size: int | None
    expandable_segments: bool
    fallbacks_applied: int


@dataclass(frozen=True)
class Supervisor:
    """The process that writes the journal: is it still there?"""

    pid: int | None
    alive: bool


@dataclass(frozen=True)
class RunPicture:
    """A run as its journal tells it."""

    run_dir: str | None
    state: str
    reason: str
    command: tuple[str, ...] | None
    attempt: int  # the current (or last) attempt's number
    plan: Plan
    supervisor: Supervisor
    attempts: tuple[Attempt, ...]
    checkpoints: tuple[Checkpoint, ...]  # newest step first, bad ones included
    progress: Data | None  # the journal's latest progress record, whichever attempt it was
    resume_points: Mapping[int, Data]  # per attempt: the checkpoint (and step) it started from
    causes: Mapping[int, Data]  # per attempt: the attribution of its memory failure (decide/attribution.py)
    own_failures: tuple[Data, ...]  # oomguard's own additions that failed an attempt (decide/ownfault.py)
    latest_sample: Data | None
    started: float | None
    updated: float | None
    # every memory_breakdown event, oldest first (also on its attempt; here for a journal whose attempt
    # rows are gone or not yet written)
    breakdowns: tuple[MemoryBreakdown, ...] = ()
    # the rest (probe, spare, liveness, forecast...), rendered as is
    meta: Data = field(repr=False, default_factory=dict)

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def failures(self) -> tuple[Attempt, ...]:
        return tuple(a for a in self.attempts if a.failed)


def plain(data: Data | None) -> dict[str, Any] | None:
    """Journal data as a dict of its own (what the documents carry), or None."""
    return None if data is None else dict(data)


def supervisor_alive(meta: Data) -> bool:
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


def attempt_peaks(attempts: Sequence[Attempt]) -> list[dict[str, Any]]:
    """Each attempt's micro-batch and peaks: the allocator's (probe), the GPU's (NVML), the RSS."""
    return [{"attempt": a.number, "micro_batch": a.micro_batch, "peak_allocated": a.peak_allocated,
             "peak_gpu": a.peak_gpu, "peak_rss": a.peak_rss} for a in attempts]


def by_world(attempts: Sequence[Attempt], now: float | None) -> list[dict[str, Any]]:
    """How long the run trained at each world size, ``[{"world_size", "seconds", "attempts"}]`` in the
    order it first trained at each: an elastic run (torchrun's ``--nnodes MIN:MAX``) that lost a node
    went on at a smaller world until the node was back. The attempts' wall time (to ``now`` for the
    one running), summed by the world size each ran at."""
    totals: dict[int, dict[str, Any]] = {}
    for a in attempts:
        end = a.ended if a.ended is not None else now
        if end is None:
            continue
        entry = totals.setdefault(a.world_size, {"world_size": a.world_size, "seconds": 0.0, "attempts": 0})
        entry["seconds"] += max(0.0, end - a.started)
        entry["attempts"] += 1
    return list(totals.values())


def read_picture(journal: Journal) -> RunPicture:
    """The run's picture from one journal connection (and the OS, for whether its supervisor runs)."""
    meta = journal.meta()
    breakdowns = _breakdowns(journal)
    attempts = tuple(Attempt.of(row, breakdowns.get(row["attempt"], ())) for row in journal.attempts())
    latest = journal.latest_samples(1)
    command = (meta.get("config") or {}).get("command")
    return RunPicture(
        run_dir=meta.get("run_dir"), state=meta.get("state", "starting"), reason=meta.get("reason", ""),
        command=None if command is None else tuple(command), attempt=meta.get("attempt", 0), plan=_plan(meta),
        supervisor=Supervisor(meta.get("supervisor_pid"), supervisor_alive(meta)),
        attempts=attempts, checkpoints=tuple(Checkpoint(**{**c, "bad": bool(c["bad"])}) for c in journal.checkpoints()),
        breakdowns=tuple(b for found in breakdowns.values() for b in found),
        progress=meta.get("progress"), resume_points=journal.event_data("resume_point"),
        causes=journal.event_data("attribution"),
        own_failures=tuple({"attempt": n, **data} for n, data in journal.event_data("own_failure").items()),
        latest_sample=latest[-1] if latest else None, started=meta.get("started"), updated=meta.get("updated"),
        meta=meta)


def _plan(meta: Data) -> Plan:
    plan, config = meta.get("plan") or {}, meta.get("config") or {}
    return Plan(micro_batch=plan.get("micro_batch", config.get("micro_batch")), grad_accum=plan.get("grad_accum"),
                global_batch=plan.get("global_batch"), asked_global=plan.get("asked_global"),
                world_size=plan.get("world_size", config.get("world_size")),
                expandable_segments=bool(plan.get("expandable_segments", False)),
                fallbacks_applied=plan.get("fallbacks_applied", 0))


def _breakdowns(journal: Journal) -> dict[int, tuple[MemoryBreakdown, ...]]:
    """Every ``memory_breakdown`` event, by attempt, in the order they were written."""
    found: dict[int, list[MemoryBreakdown]] = {}
    for attempt, data in journal.all_event_data("memory_breakdown"):
        if attempt is not None and (value := memoryparts.parse(data, attempt)) is not None:
            found.setdefault(attempt, []).append(value)
    return {n: tuple(items) for n, items in found.items()}
