"""Read-only journal connections for the web layer, one per thread.

The supervisor's own ``Journal`` serialises its users with a lock; if request threads shared it, a
slow query would hold up the loop's next write. Each web thread instead opens its own read-only
connection (SQLite WAL: readers never block the writer) and keeps it for later requests.
"""

from __future__ import annotations

import threading
from pathlib import Path

from supervisor.journal import Journal


class JournalUnavailable(RuntimeError):
    """The run directory has no journal (yet)."""


class JournalPool:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._local = threading.local()
        self._all: list[Journal] = []
        self._lock = threading.Lock()

    def get(self) -> Journal:
        journal: Journal | None = getattr(self._local, "journal", None)
        if journal is None:
            try:
                journal = Journal(self.run_dir, readonly=True)
            except FileNotFoundError:
                raise JournalUnavailable(f"no journal in {self.run_dir}") from None
            self._local.journal = journal
            with self._lock:
                self._all.append(journal)
        return journal

    def close(self) -> None:
        with self._lock:
            journals, self._all = self._all, []
        for journal in journals:
            journal.close()


def last_event_id(journal: Journal) -> int:
    """The newest event id, where a fresh live stream starts. ``Journal`` has no public query for
    it and paging through ``events()`` from 0 costs a scan of the whole run."""
    rows = journal._query("SELECT coalesce(max(id), 0) AS id FROM events")
    return int(rows[0]["id"])
