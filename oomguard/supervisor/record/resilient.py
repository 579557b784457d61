"""The supervisor's journal when the disk under it fills up: writes degrade, supervision goes on.

Tested in tests/e2e/faults/test_disk_full.py and tests/unit/supervisor/ops/test_notify.py.

``sqlite3.OperationalError: database or disk is full`` (or any I/O error) from a journal write used to
end the supervisor, whose ``finally`` then killed the healthy worker. ``ResilientJournal`` is the
same journal with every write guarded: a memory sample that cannot be written is dropped (they are
many and expendable), a fact that matters (a transition, an attempt's start or end, an event, the
plan) is kept in memory and written, in order, as soon as the journal can be written again. While
degraded only one write every ``PROBE_EVERY`` seconds touches the disk, so a full disk costs the
loop nothing. The degradation is said once (``Degradations``) and journaled as a ``degraded`` event
when it ends.

Also here:

- Our own bookkeeping failing: what is degraded right now, said once when it starts and once when it ends.
"""

from __future__ import annotations

import functools
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from oomguard.supervisor.record.journal import Journal

# Our own bookkeeping failing: what is degraded right now, said once when it starts and once when it ends.
#
# The journal, the attempt logs, the dashboard, the hooks and the memory sampler are all bookkeeping
# around the worker; none of them failing may stop supervision or kill a healthy worker. Each reports
# its trouble here: the first failure of a component is logged (the console or the status line) and
# kept for ``oomguard status``; later failures of the same component only count; the first success
# after that logs the recovery and what was lost meanwhile.


@dataclass
class Problem:
    component: str  # "journal", "log", "web", "hooks", "sampling", "output"
    message: str  # the first failure, e.g. "database or disk is full"
    since: float  # wall clock, for people
    lost: int = 0  # writes, samples or bytes dropped while degraded
    unit: str = "writes"  # what ``lost`` counts
    said: bool = True  # logged (a relapse soon after a recovery is not said again)

    def as_dict(self) -> dict[str, Any]:
        return {"component": self.component, "message": self.message, "since": self.since, "lost": self.lost,
                "unit": self.unit}


RELAPSE_QUIET = 60.0  # seconds after a recovery in which a new failure of it is not said again


class Degradations:
    """Thread-safe: the output thread, the web thread and the loop all report here. A nearly full disk
    flaps (one write fits, the next does not); a relapse within ``RELAPSE_QUIET`` seconds of a recovery
    is tracked but not said, and neither is its end."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._active: dict[str, Problem] = {}
        self._lock = threading.Lock()
        self.history: list[Problem] = []  # ended degradations, for the journal once it can be written
        self.version = 0  # bumped at every start and end of a degradation (the loop republishes then)
        self._recovered_at: dict[str, float] = {}

    def failed(self, component: str, error: BaseException | str, lost: int = 1, what: str = "",
               unit: str = "writes") -> bool:
        """Record a failure; True (and one log line) when it starts a degradation."""
        with self._lock:
            problem = self._active.get(component)
            if problem is not None:
                problem.lost += lost
                return False
            message = _describe(error)
            relapse = time.monotonic() - self._recovered_at.get(component, -RELAPSE_QUIET) < RELAPSE_QUIET
            self._active[component] = Problem(component, message, time.time(), lost, unit, said=not relapse)
            self.version += 1
        if not relapse:
            self._quiet_say(f"{component} degraded: {message}{what}; the worker keeps running")
        return not relapse

    def recovered(self, component: str) -> Problem | None:
        """Record a success; the degradation it ends (and one log line), or None."""
        with self._lock:
            problem = self._active.pop(component, None)
            if problem is None:
                return None
            self.history.append(problem)
            self.version += 1
            self._recovered_at[component] = time.monotonic()
        if problem.said:
            self._quiet_say(f"{component} recovered after {time.time() - problem.since:.0f} s "
                            f"({problem.lost} {problem.unit} lost while degraded)")
        return problem

    def drain(self) -> list[Problem]:
        """The degradations that ended since the last call (to journal them)."""
        with self._lock:
            ended, self.history = self.history, []
        return ended

    def is_degraded(self, component: str) -> bool:
        return component in self._active

    def active(self) -> list[dict[str, Any]]:
        with self._lock:
            return [p.as_dict() for p in self._active.values()]

    def _quiet_say(self, text: str) -> None:
        try:
            self._say(text)
        except Exception:  # the console itself may be what failed; nothing is left to tell
            return


def _describe(error: BaseException | str) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}" + (f" ({error.filename})" if error.filename else "")
    return str(error) or type(error).__name__


T = TypeVar("T")
PROBE_EVERY = 2.0  # seconds between tries to write while the journal is degraded
RETRIES = 2  # extra tries of an important write before it is queued
RETRY_DELAY = 0.05
MAX_PENDING = 10_000  # important writes kept while degraded; the oldest are dropped past this
COMPONENT = "journal"
_FAILURES = (sqlite3.Error, OSError)


class ResilientJournal(Journal):
    """A ``Journal`` whose writes never raise (reads still do: they are the callers' business)."""

    def __init__(self, run_dir: Path, degradations: Degradations, probe_every: float = PROBE_EVERY) -> None:
        super().__init__(run_dir)
        self.degradations = degradations
        self.probe_every = probe_every
        self._pending: list[Callable[[], object]] = []
        self._next_probe = 0.0

    # --- the guard ----------------------------------------------------------------------------

    def _try(self, write: Callable[[], T], retries: int) -> tuple[bool, T | None]:
        for attempt in range(retries + 1):
            try:
                return True, write()
            except _FAILURES as exc:
                if attempt == retries:
                    self.degradations.failed(COMPONENT, exc, lost=0, what=f" ({self.path})")
                else:
                    time.sleep(RETRY_DELAY)
        return False, None

    def _may_write(self) -> bool:
        """Healthy, or degraded and due for a probe."""
        if not self.degradations.is_degraded(COMPONENT):
            return True
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + self.probe_every
        return True

    def _flush(self) -> bool:
        """Write what was kept while degraded, oldest first; True once nothing is left."""
        while self._pending:
            ok, _ = self._try(self._pending[0], 0)
            if not ok:
                return False
            self._pending.pop(0)
        problem = self.degradations.recovered(COMPONENT)
        if problem is not None or self.degradations.history:
            self._journal_history()
        return True

    def _journal_history(self) -> None:
        for problem in self.degradations.drain():
            self._try(functools.partial(super().event, "degraded", None, **problem.as_dict(), until=time.time()), 0)

    def _important(self, write: Callable[[], T], default: T) -> T:
        """A write that must reach the journal: now, or in order once it can be written."""
        if self._may_write() and self._flush():
            ok, value = self._try(write, RETRIES if not self.degradations.is_degraded(COMPONENT) else 0)
            if ok:
                self._flush()  # a recovery noticed by this write
                return value  # type: ignore[return-value]
        self._keep(write)
        return default

    def _expendable(self, write: Callable[[], T], default: T) -> T:
        """A write that may be lost (a memory sample, downsampling): dropped while degraded."""
        if self._may_write() and self._flush():
            ok, value = self._try(write, 0)
            if ok:
                self._flush()
                return value  # type: ignore[return-value]
        self.degradations.failed(COMPONENT, "dropping writes", lost=1)
        return default

    def _keep(self, write: Callable[[], object]) -> None:
        self._pending.append(write)
        if len(self._pending) > MAX_PENDING:
            del self._pending[0]
        self.degradations.failed(COMPONENT, "keeping writes in memory", lost=1)

    def close(self) -> None:
        """The last chance for what was kept: a few tries now, whatever the probe interval, then
        say what is lost (the supervisor is exiting; memory is all it had)."""
        for _ in range(3):
            self._next_probe = 0.0
            if not self._pending or (self._may_write() and self._flush()):
                break
            time.sleep(0.2)
        if self._pending:
            self.degradations.failed(COMPONENT, "exiting", lost=0)
            self.degradations._say(f"{len(self._pending)} journal writes could not be saved: the disk under "
                                   f"{self.path} is still full")
        super().close()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # --- the writes ---------------------------------------------------------------------------

    def set_meta(self, **values: Any) -> None:
        self._important(functools.partial(super().set_meta, **values), None)

    def event(self, name: str, attempt: int | None = None, /, **data: Any) -> int:
        return self._important(functools.partial(super().event, name, attempt, **data), 0)

    def transition(self, old: str, new: str, reason: str, attempt: int | None) -> None:
        self._important(functools.partial(super().transition, old, new, reason, attempt), None)

    def start_attempt(self, attempt: int, pid: int, plan: dict[str, Any], checkpoint: str | None,
                      command: list[str], log_path: str) -> None:
        self._important(functools.partial(super().start_attempt, attempt, pid, plan, checkpoint, command,
                                          log_path), None)

    def end_attempt(self, attempt: int, **fields: Any) -> None:
        self._important(functools.partial(super().end_attempt, attempt, **fields), None)

    def mark_bad(self, path: str, reason: str) -> None:
        self._important(functools.partial(super().mark_bad, path, reason), None)

    def clear_bad(self, path: str, mtime: float) -> None:
        self._important(functools.partial(super().clear_bad, path, mtime), None)

    def record_sample(self, attempt: int, data: dict[str, Any], t: float, rss: int | None, gpu: int | None,
                      step: int | None, progress: dict[str, Any] | None) -> None:
        self._expendable(functools.partial(super().record_sample, attempt, data, t, rss, gpu, step, progress),
                         None)

    def checkpoint_seen(self, path: str, step: int | None, mtime: float, attempt: int | None) -> bool:
        # Not kept: the loop asks again on every scan, so a checkpoint is recorded once writes work.
        return self._expendable(functools.partial(super().checkpoint_seen, path, step, mtime, attempt), False)

    def thin_samples(self, now: float | None = None) -> int:
        return self._expendable(functools.partial(super().thin_samples, now), 0)
