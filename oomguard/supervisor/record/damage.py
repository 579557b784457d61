"""A journal that cannot be read: found out at open, said in one line, never overwritten.

A journal cut in half (a copy interrupted, a disk that lost blocks), filled with garbage or left at
zero bytes used to give tracebacks from ``status``, ``report``, ``stop`` and ``run`` (and ``run``
would have started writing a new journal into an empty file). ``check`` looks before SQLite does:
the file's header, its size against the page count the header promises, and a query (``run``
also asks SQLite's ``quick_check``). What it finds is a ``JournalDamaged``: the file and the fix.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from oomguard.supervisor.errors import UsageError

MAGIC = b"SQLite format 3\x00"
BEING_CREATED = 5.0  # seconds: a younger empty or table-less journal is being created, not damaged


class JournalDamaged(UsageError):
    def __init__(self, path: Path, why: str) -> None:
        super().__init__("--run-dir", f"the journal {path} cannot be read: {why}",
                         f"move it aside (mv {path} {path}.damaged) and run again, or use another --run-dir; "
                         "oomguard never overwrites it")


def check(path: Path, thorough: bool = False) -> None:
    """Raise ``JournalDamaged`` if the journal at ``path`` exists but cannot be a readable journal.
    ``thorough`` is the supervisor's own open (under the run lock, so nobody else is creating it)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(100)
            size = fh.seek(0, 2)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise JournalDamaged(path, exc.strerror or str(exc)) from None
    if size == 0:
        if not thorough and _young(path):  # a supervisor is creating it right now: not damage
            return
        raise JournalDamaged(path, "it is empty (0 bytes)")
    if not head.startswith(MAGIC) or len(head) < 100:
        raise JournalDamaged(path, "it is not an SQLite database")
    _check_size(path, head, size)
    _probe(path, thorough)


def _young(path: Path) -> bool:
    return time.time() - path.stat().st_mtime < BEING_CREATED


def _check_size(path: Path, head: bytes, size: int) -> None:
    """The header's page count is valid when its change counter matches version-valid-for (SQLite's
    file format, section 1.3.7); a file shorter than it was cut."""
    page_size = int.from_bytes(head[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(head[28:32], "big")
    valid = head[24:28] == head[92:96]
    if valid and pages and size < pages * page_size:
        raise JournalDamaged(path, f"it is cut short ({size} of {pages * page_size} bytes)")


def _probe(path: Path, thorough: bool) -> None:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        try:
            db.execute("SELECT count(*) FROM meta").fetchone()
            if thorough:
                result = db.execute("PRAGMA quick_check").fetchone()[0]
                if result != "ok":
                    raise JournalDamaged(path, f"SQLite's quick_check says {result}")
        finally:
            db.close()
    except sqlite3.OperationalError as exc:
        if str(exc).startswith("no such table") and not thorough and _young(path):
            return  # the creating supervisor has not written the schema yet
        raise JournalDamaged(path, str(exc)) from None
    except sqlite3.DatabaseError as exc:
        raise JournalDamaged(path, str(exc)) from None
