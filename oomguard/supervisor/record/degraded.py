"""Our own bookkeeping failing: what is degraded right now, said once when it starts and once when it ends.

The journal, the attempt logs, the dashboard, the hooks and the memory sampler are all bookkeeping
around the worker; none of them failing may stop supervision or kill a healthy worker. Each reports
its trouble here: the first failure of a component is logged (the console or the status line) and
kept for ``oomguard status``; later failures of the same component only count; the first success
after that logs the recovery and what was lost meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
