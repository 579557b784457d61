"""Read-only journal connections for the web layer, one per thread.

The supervisor's own ``Journal`` serialises its users with a lock; if request threads shared it, a
slow query would hold up the loop's next write. Each web thread instead opens its own read-only
connection (SQLite WAL: readers never block the writer) and keeps it for later requests.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from oomguard.supervisor.record.journal import Journal, journal_path
from oomguard.supervisor.record.status import status_document
from oomguard.web import exposure as redact


class JournalUnavailable(RuntimeError):
    """The run directory has no journal (yet)."""


class JournalPool:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = journal_path(run_dir)
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


class StatusCache:
    """The status document as JSON bytes, rebuilt only when the journal files changed.

    Scripts poll status many times a second; rebuilding it costs SQL, psutil and serialisation under
    the GIL the supervision loop shares. A stat of the two journal files says whether anything was
    committed; ``max_age`` bounds staleness of ``supervisor_alive``, which no commit announces.
    """

    def __init__(self, pool: JournalPool, max_age: float = 1.0) -> None:
        self.pool = pool
        self.max_age = max_age
        self._lock = threading.Lock()
        self._key: tuple[int, ...] | None = None
        self._at = 0.0
        self._body = b""

    def _journal_key(self) -> tuple[int, ...]:
        key: list[int] = []
        for path in (self.pool.path, self.pool.path.with_name(self.pool.path.name + "-wal")):
            try:
                st = path.stat()
                key += [st.st_mtime_ns, st.st_size, st.st_ino]
            except FileNotFoundError:
                key += [0, 0, 0]
        return tuple(key)

    def get(self) -> bytes:
        key, now = self._journal_key(), time.monotonic()  # before reading: a later commit re-keys
        with self._lock:
            if key == self._key and now - self._at < self.max_age:
                return self._body
        body = json.dumps(redact.status(status_document(self.pool.get())), default=str).encode()
        with self._lock:
            self._key, self._at, self._body = key, now, body
        return body
