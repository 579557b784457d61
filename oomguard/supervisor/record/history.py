"""A run's whole history from its journal, for the report: the picture (``picture.py``) and what
only a pass over every event gives (each attempt's highest step and last activity, every checkpoint
write, the decisions, the in-process batch changes, the warnings, the run's last state change).

Progress records are many (one a step) and are only summarised; one pass reads them a page at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.picture import Checkpoint, Data, RunPicture, read_picture

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
