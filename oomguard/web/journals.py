"""Read-only journal connections for the web layer, one per thread.

Tested in tests/e2e/web/test_web_api.py.

The supervisor's own ``Journal`` serialises its users with a lock; if request threads shared it, a
slow query would hold up the loop's next write. Each web thread instead opens its own read-only
connection (SQLite WAL: readers never block the writer) and keeps it for later requests.

A kept connection must never serve an old snapshot: under WAL, a connection with a statement left
open stays inside its read transaction and sees the journal as it was when that began (``/metrics``
once served step 100 for 30 s while the run went on). So each hand-out checks that a connection
whose journal files changed since it last looked also saw a commit (``PRAGMA data_version``), and
replaces one that did not.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from oomguard.supervisor.record.journal import Journal, journal_path
from oomguard.supervisor.record.status import status_document
from oomguard.web import exposure as redact
from oomguard.web import models


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
        if journal is not None and self._pinned(journal):
            self._drop(journal)
            journal = None
        if journal is None:
            try:
                journal = Journal(self.run_dir, readonly=True)
            except FileNotFoundError:
                raise JournalUnavailable(f"no journal in {self.run_dir}") from None
            self._local.journal = journal
            with self._lock:
                self._all.append(journal)
            self._pinned(journal)  # where it starts: its files and the commits it has seen
        return journal

    def _pinned(self, journal: Journal) -> bool:
        """Did the journal's files change (a commit, or a checkpoint of the WAL) while this
        connection saw no commit? Then it is held in an old read snapshot. A checkpoint alone
        answers yes too: the connection is replaced for nothing, which costs one open."""
        key, version = journal_key(self.path), journal.data_version()
        seen = (getattr(self._local, "key", None), getattr(self._local, "version", None))
        self._local.key, self._local.version = key, version
        return seen[0] is not None and key != seen[0] and version == seen[1]

    def _drop(self, journal: Journal) -> None:
        with self._lock:
            self._all = [j for j in self._all if j is not journal]
        self._local.journal = None
        self._local.key = self._local.version = None
        journal.close()

    def close(self) -> None:
        with self._lock:
            journals, self._all = self._all, []
        for journal in journals:
            journal.close()


def last_event_id(journal: Journal) -> int:
    """The newest event id, where a fresh live stream starts."""
    return journal.last_event_id()


def journal_key(path: Path) -> tuple[int, ...]:
    """What changes when anything is committed to the journal: the database and its WAL's
    modification time, size and inode."""
    key: list[int] = []
    for file in (path, path.with_name(path.name + "-wal")):
        try:
            st = file.stat()
            key += [st.st_mtime_ns, st.st_size, st.st_ino]
        except FileNotFoundError:
            key += [0, 0, 0]
    return tuple(key)


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

    def get(self) -> bytes:
        key, now = journal_key(self.pool.path), time.monotonic()  # before reading: a later commit re-keys
        with self._lock:
            if key == self._key and now - self._at < self.max_age:
                return self._body
        # Validated by the API's model: what /api/status returns is what its schema says.
        doc = models.STATUS.validate_python(redact.status(status_document(self.pool.get())))
        body = models.STATUS.dump_json(doc)
        with self._lock:
            self._key, self._at, self._body = key, now, body
        return body
