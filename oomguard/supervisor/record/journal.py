"""The run journal: a SQLite database in WAL mode in the run directory.

Everything a person or a later supervisor needs to know about the run lives here: attempts and how
they ended, decisions, checkpoints seen (and which were bad), state changes, the current batch
plan, memory samples. WAL with ``synchronous=FULL`` makes every committed write survive ``kill -9``
(and power loss); readers in other processes or threads never block the supervisor's writes.

Also here: a journal that cannot be read (found out at open, said in one line, never overwritten);
bounded storage for memory samples; ``write_atomic`` for a small file that must survive ``kill -9``
and never be read half-written; and the journal when the disk under it fills up (``ResilientJournal``,
tested in tests/e2e/faults/test_disk_full.py): writes degrade, supervision goes on.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from oomguard.supervisor.lifecycle import UsageError

JOURNAL_NAME = "journal.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, kind TEXT NOT NULL,
    attempt INTEGER, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS attempts (
    attempt INTEGER PRIMARY KEY, started REAL NOT NULL, ended REAL, pid INTEGER,
    micro_batch INTEGER NOT NULL, grad_accum INTEGER NOT NULL, global_batch INTEGER NOT NULL,
    world_size INTEGER NOT NULL, checkpoint TEXT, command TEXT NOT NULL, log_path TEXT NOT NULL,
    expandable_segments INTEGER NOT NULL DEFAULT 0, fallbacks_applied INTEGER NOT NULL DEFAULT 0,
    returncode INTEGER, exit_code INTEGER, signal INTEGER, kind TEXT, evidence TEXT, decision TEXT,
    last_step INTEGER, peak_rss INTEGER, peak_gpu INTEGER, ending TEXT, stop_reason TEXT, peak_allocated INTEGER);
CREATE TABLE IF NOT EXISTS checkpoints (
    path TEXT PRIMARY KEY, step INTEGER, mtime REAL NOT NULL, first_seen REAL NOT NULL,
    attempt INTEGER, bad INTEGER NOT NULL DEFAULT 0, reason TEXT);
CREATE TABLE IF NOT EXISTS checkpoint_writes (
    path TEXT NOT NULL, mtime REAL NOT NULL, step INTEGER, attempt INTEGER, seen REAL NOT NULL,
    PRIMARY KEY (path, mtime));
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, attempt INTEGER, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS samples_t ON samples (t);
CREATE INDEX IF NOT EXISTS events_attempt ON events (attempt);
"""


# Columns added after the first release: how an attempt ended (lifecycle.Ending), why oomguard
# stopped its worker (lifecycle.StopReason), and the allocator's highest step peak the probe saw.
_ADDED_COLUMNS = (("ending", "TEXT"), ("stop_reason", "TEXT"), ("peak_allocated", "INTEGER"))


def journal_path(run_dir: Path) -> Path:
    return Path(run_dir) / JOURNAL_NAME


def open_existing(run_dir: Path) -> Journal:
    """A read-only journal of an existing run, or the one-line error that names --run-dir."""
    try:
        return Journal(run_dir, readonly=True)
    except FileNotFoundError:  # none, or one being created this instant
        raise UsageError("--run-dir", f"no oomguard run in {run_dir}", "pass the --run-dir given to oomguard run"
                         ) from None


class Journal:
    """One connection to a run's journal. Thread-safe; each process opens its own."""

    def __init__(self, run_dir: Path, readonly: bool = False) -> None:
        self.path = journal_path(run_dir)
        check(self.path, thorough=not readonly)  # a damaged journal: one line, and never overwritten
        if readonly:
            if not self.path.exists():
                raise FileNotFoundError(self.path)
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False, timeout=10)
        else:
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            # A journal written before a column existed gets it (NULL for its old rows): a run directory
            # outlives upgrades of oomguard.
            have = {row[1] for row in self._db.execute("PRAGMA table_info(attempts)")}
            for column, kind in _ADDED_COLUMNS:
                if column not in have:
                    self._db.execute(f"ALTER TABLE attempts ADD COLUMN {column} {kind}")
            self._db.commit()
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._db:
            yield self._db

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """Every row, and the statement closed whatever happens: an open statement keeps its
        connection's read snapshot (WAL), and later reads on it would not see newer commits."""
        with self._lock, closing(self._db.execute(sql, args)) as cursor:
            return cursor.fetchall()

    # --- writes (the supervisor) -------------------------------------------------------------

    def set_meta(self, **values: Any) -> None:
        with self._write() as db:
            _put_meta(db, values)

    def event(self, name: str, attempt: int | None = None, /, **data: Any) -> int:
        with self._write() as db:
            return _add_event(db, name, attempt, data)

    def transition(self, old: str, new: str, reason: str, attempt: int | None) -> None:
        """Record a state change; the caller (the loop's one transition point) has checked it."""
        with self._write() as db:
            _add_event(db, "state", attempt, {"from": old, "to": new, "reason": reason})
            _put_meta(db, {"state": new, "reason": reason, "updated": time.time()})

    def start_attempt(self, attempt: int, pid: int, plan: dict[str, Any], checkpoint: str | None,
                      command: list[str], log_path: str) -> None:
        with self._write() as db:
            db.execute(
                "INSERT OR REPLACE INTO attempts (attempt, started, pid, micro_batch, grad_accum, global_batch, "
                "world_size, checkpoint, command, log_path, expandable_segments, fallbacks_applied) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (attempt, time.time(), pid, plan["micro_batch"], plan["grad_accum"], plan["global_batch"],
                 plan["world_size"], checkpoint, json.dumps(command), log_path,
                 int(plan.get("expandable_segments", False)), plan.get("fallbacks_applied", 0)))

    def end_attempt(self, attempt: int, **fields: Any) -> None:
        """End an attempt now, or at ``ended`` (Unix time) when it is closed later than it ended."""
        allowed = {"returncode", "exit_code", "signal", "kind", "evidence", "decision", "last_step",
                   "peak_rss", "peak_gpu", "ending", "stop_reason", "peak_allocated"}
        cols = [k for k in fields if k in allowed]
        ended = fields.get("ended")
        with self._write() as db:
            db.execute(f"UPDATE attempts SET ended = ?, {', '.join(f'{c} = ?' for c in cols)} "
                       "WHERE attempt = ?", (time.time() if ended is None else ended,
                                             *(fields[c] for c in cols), attempt))

    def record_sample(self, attempt: int, data: dict[str, Any], t: float, rss: int | None, gpu: int | None,
                      step: int | None, progress: dict[str, Any] | None) -> None:
        """One sample, the attempt's peaks and the latest progress, in one transaction (one fsync a
        second is the supervisor's main steady cost)."""
        with self._write() as db:
            db.execute("INSERT INTO samples (t, attempt, data) VALUES (?, ?, ?)", (t, attempt, json.dumps(data)))
            db.execute("UPDATE attempts SET peak_rss = max(coalesce(peak_rss, 0), coalesce(?, 0)), "
                       "peak_gpu = max(coalesce(peak_gpu, 0), coalesce(?, 0)), "
                       "last_step = coalesce(?, last_step) WHERE attempt = ?", (rss, gpu, step, attempt))
            if progress is not None:  # tagged with its attempt: status tells it from an earlier attempt's
                _put_meta(db, {"progress": {**progress, "attempt": attempt}})

    def checkpoint_seen(self, path: str, step: int | None, mtime: float, attempt: int | None) -> bool:
        """Record a checkpoint; True when it is new to the journal, or rewritten at a later step (a
        script that keeps one file, like nanoGPT's ``ckpt.pt``, makes progress by rewriting it; the
        same step written again after a resume is not progress).

        Each write (a new mtime) is also kept as first seen, with its step and the attempt that wrote
        it, in ``checkpoint_writes``: a file rewritten later under the same name (Lightning re-saves the
        one it resumed from) or deleted by rotation still counts for the attempt that wrote it."""
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO checkpoint_writes (path, mtime, step, attempt, seen) VALUES (?,?,?,?,?)",
                       (path, mtime, step, attempt, time.time()))
            cur = db.execute("INSERT OR IGNORE INTO checkpoints (path, step, mtime, first_seen, attempt) "
                             "VALUES (?, ?, ?, ?, ?)", (path, step, mtime, time.time(), attempt))
            if cur.rowcount > 0:
                return True
            old_step, old_mtime = db.execute("SELECT step, mtime FROM checkpoints WHERE path = ?", (path,)).fetchone()
            if mtime <= old_mtime:
                return False
            # A new write under the same name: its step and writer are this write's, unknown when
            # unknown. The old write's step would claim work this file may no longer hold.
            db.execute("UPDATE checkpoints SET mtime = ?, step = ?, attempt = ? WHERE path = ?",
                       (mtime, step, attempt, path))
            return step is None or old_step is None or step > old_step

    def mark_bad(self, path: str, reason: str) -> None:
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO checkpoints (path, step, mtime, first_seen) VALUES (?, NULL, 0, ?)",
                       (path, time.time()))
            db.execute("UPDATE checkpoints SET bad = 1, reason = ? WHERE path = ?", (reason, path))

    def thin_samples(self, now: float | None = None) -> int:
        """Downsample old memory samples (each attempt's peak is kept for ever); rows deleted."""
        rows = [SampleRow(r["id"], r["attempt"] or 0, r["t"], d.get("worker_rss_bytes"), d.get("gpu_worker_bytes"))
                for r in self._query("SELECT id, attempt, t, data FROM samples")
                for d in (json.loads(r["data"]),)]
        drop = rows_to_drop(rows, time.time() if now is None else now)
        with self._write() as db:
            db.executemany("DELETE FROM samples WHERE id = ?", [(i,) for i in drop])
        return len(drop)

    # --- reads (anyone) ----------------------------------------------------------------------

    def meta(self) -> dict[str, Any]:
        return {row["key"]: json.loads(row["value"]) for row in self._query("SELECT key, value FROM meta")}

    def bad_checkpoints(self) -> set[str]:
        return set(self.bad_marks())

    def bad_marks(self) -> dict[str, float]:
        """Each checkpoint marked bad, with the mtime of the write that was marked."""
        return {row["path"]: row["mtime"] for row in self._query("SELECT path, mtime FROM checkpoints WHERE bad = 1")}

    def clear_bad(self, path: str, mtime: float) -> None:
        """The file was written again since it was marked bad: the new write is judged on its own."""
        with self._write() as db:
            db.execute("UPDATE checkpoints SET bad = 0, reason = NULL, mtime = ? WHERE path = ?", (mtime, path))

    def attempts(self) -> list[dict[str, Any]]:
        rows = self._query("SELECT * FROM attempts ORDER BY attempt")
        return [{**dict(r), "command": json.loads(r["command"])} for r in rows]

    def events(self, since_id: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        return self._events("SELECT * FROM events WHERE id > ? ORDER BY id LIMIT ?", (since_id, limit))

    def _events(self, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        return [{**dict(r), "data": json.loads(r["data"])} for r in self._query(sql, args)]

    def last_event_id(self) -> int:
        """The id of the newest event (0 when there is none): where a reader starts following."""
        return int(self._query("SELECT max(id) FROM events")[0][0] or 0)

    def event_data(self, kind: str) -> dict[int, dict[str, Any]]:
        """The data of the newest event of ``kind`` for each attempt."""
        return {attempt: data for attempt, data in self.all_event_data(kind) if attempt is not None}

    def data_version(self) -> int:
        """SQLite's count of commits by other connections as this connection sees them: unchanged
        while a statement left open holds it in an old snapshot."""
        return int(self._query("PRAGMA data_version")[0][0])

    def all_event_data(self, kind: str) -> list[tuple[int | None, dict[str, Any]]]:
        """(attempt, data) of every event of ``kind``, oldest first."""
        rows = self._query("SELECT attempt, data FROM events WHERE kind = ? ORDER BY id", (kind,))
        return [(r["attempt"], json.loads(r["data"])) for r in rows]

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        """Every event of ``kind``, oldest first (the memory breakdowns: one per rank per failure)."""
        return self._events("SELECT * FROM events WHERE kind = ? ORDER BY id", (kind,))

    def last_activity(self, attempt: int) -> float | None:
        """When an attempt was last heard of (its newest event or memory sample): when it ended, for
        an attempt whose supervisor ended before it could say so."""
        return self._query("SELECT max(t) FROM (SELECT t FROM events WHERE attempt = ? "
                           "UNION ALL SELECT t FROM samples WHERE attempt = ?)", (attempt, attempt))[0][0]

    def checkpoints(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._query(
            "SELECT * FROM checkpoints ORDER BY coalesce(step, -1) DESC, mtime DESC")]

    def checkpoint_writes(self) -> list[dict[str, Any]]:
        """Every write of every checkpoint as first seen, oldest first (see ``checkpoint_seen``); empty
        for a journal written before writes were kept (opened read-only, it has no such table)."""
        try:
            return [dict(r) for r in self._query("SELECT * FROM checkpoint_writes ORDER BY mtime, path")]
        except sqlite3.OperationalError:
            return []

    def latest_samples(self, n: int) -> list[dict[str, Any]]:
        rows = self._query("SELECT t, attempt, data FROM samples ORDER BY id DESC LIMIT ?", (n,))
        return [{"t": r["t"], "attempt": r["attempt"], **json.loads(r["data"])} for r in reversed(rows)]

    def samples(self, start: float | None = None, end: float | None = None,
                max_points: int = 2000) -> list[dict[str, Any]]:
        rows = self._query("SELECT t, attempt, data FROM samples WHERE t >= ? AND t <= ? ORDER BY t",
                           (start or 0.0, end if end is not None else 1e18))
        step = max(1, len(rows) // max(1, max_points))
        return [{"t": r["t"], "attempt": r["attempt"], **json.loads(r["data"])} for r in rows[::step]]


def _put_meta(db: sqlite3.Connection, values: dict[str, Any]) -> None:
    db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                   [(k, json.dumps(v)) for k, v in values.items()])


def _add_event(db: sqlite3.Connection, name: str, attempt: int | None, data: dict[str, Any]) -> int:
    cur = db.execute("INSERT INTO events (t, kind, attempt, data) VALUES (?, ?, ?, ?)",
                     (time.time(), name, attempt, json.dumps(data, default=str)))
    return int(cur.lastrowid or 0)


# A journal that cannot be read: found out at open, said in one line, never overwritten.
#
# A journal cut in half (a copy interrupted, a disk that lost blocks), filled with garbage or left at
# zero bytes used to give tracebacks from ``status``, ``report``, ``stop`` and ``run`` (and ``run``
# would have started writing a new journal into an empty file). ``check`` looks before SQLite does:
# the file's header, its size against the page count the header promises, and a query (``run``
# also asks SQLite's ``quick_check``). What it finds is a ``JournalDamaged``: the file and the fix.


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
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            db.execute("SELECT count(*) FROM meta").fetchone()
            result = db.execute("PRAGMA quick_check").fetchone()[0] if thorough else "ok"
            if result != "ok":
                raise JournalDamaged(path, f"SQLite's quick_check says {result}")
    except sqlite3.DatabaseError as exc:  # OperationalError too
        if str(exc).startswith("no such table") and not thorough and _young(path):
            return  # the creating supervisor has not written the schema yet
        raise JournalDamaged(path, str(exc)) from None


# Bounded storage for memory samples: which journal rows to keep as they age.
#
# The journal stores one row per sample (1 Hz by default). ``rows_to_drop`` says which rows to
# delete so that storage stays bounded on runs of weeks:
#
# - samples younger than ``recent_s`` stay at full rate;
# - older ones keep, per attempt and per time bucket, only the row with the highest host memory and
#   the row with the highest GPU memory, so a chart of old history still shows the peaks; buckets
#   grow coarser with age (``tiers``);
# - every attempt's peak rows (host and GPU) are kept for ever.
#
# Buckets are aligned to absolute time (not to "now"), so running it again over already thinned
# rows keeps the same rows: the journal can call it every few minutes over the whole table.


@dataclass(frozen=True)
class SampleRow:
    """The fields of a journal sample row that retention looks at. ``t`` in seconds (wall)."""

    id: int
    attempt: int
    t: float
    host_bytes: int | None
    gpu_bytes: int | None


@dataclass(frozen=True)
class Retention:
    """``recent_s`` at full rate, then (min age, bucket width) tiers, youngest tier first."""

    recent_s: float = 600.0
    tiers: tuple[tuple[float, float], ...] = ((600.0, 60.0), (86_400.0, 900.0))

    def __post_init__(self) -> None:
        ages = [age for age, _ in self.tiers]
        if self.recent_s < 0 or ages != sorted(ages) or any(width <= 0 for _, width in self.tiers):
            raise ValueError("retention tiers must have increasing ages and positive bucket widths")

    def bucket_width(self, age: float) -> float | None:
        """Bucket width for a row this old (its oldest tier's), or None while it is recent."""
        if age < self.recent_s:
            return None
        return next((width for min_age, width in reversed(self.tiers) if age >= min_age), None)


def rows_to_drop(rows: Iterable[SampleRow], now: float, policy: Retention | None = None) -> list[int]:
    """Ids of rows the journal may delete now (pure; ``rows`` in any order)."""
    policy = policy or Retention()
    rows = list(rows)
    keep = _attempt_peaks(rows)
    buckets: dict[tuple[int, float, int], list[SampleRow]] = {}
    for row in rows:
        width = policy.bucket_width(now - row.t)
        if width is None:
            keep.add(row.id)
            continue
        buckets.setdefault((row.attempt, width, int(row.t // width)), []).append(row)
    for members in buckets.values():  # each bucket's highest host row, and highest GPU row (earliest on ties)
        keep.add(max(members, key=lambda r: (r.host_bytes or 0, -r.t)).id)
        if any(r.gpu_bytes is not None for r in members):
            keep.add(max(members, key=lambda r: (r.gpu_bytes or 0, -r.t)).id)
    return sorted(row.id for row in rows if row.id not in keep)


def _attempt_peaks(rows: Sequence[SampleRow]) -> set[int]:
    """Ids of each attempt's highest host row and highest GPU row (earliest on ties)."""
    best: dict[tuple[int, str], SampleRow] = {}
    for row in rows:
        for kind in ("host_bytes", "gpu_bytes"):
            value, current = getattr(row, kind), best.get((row.attempt, kind))
            if value is not None and (current is None or (value, -row.t) > (getattr(current, kind), -current.t)):
                best[(row.attempt, kind)] = row
    return {row.id for row in best.values()}


# One way to write a small file that must survive ``kill -9`` and never be read half-written.
#
# The unit files, the control token, the per-attempt copies of ``--edit`` config files and the
# checkpoint request all go through ``write_atomic``: a fresh temporary file in the same directory
# (``mkstemp``: O_EXCL, so a planted symlink is never followed), fsynced, renamed over the target,
# and the directory fsynced so the rename itself survives a crash. A reader sees the old content or
# the new, never a mix.


def write_atomic(path: Path, text: str, mode: int = 0o644) -> Path:
    """Write ``text`` to ``path`` atomically with ``mode`` (not masked by the umask); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), mode)  # before the content: a 0600 secret is never readable by others
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


# The journal when the disk under it fills up: writes degrade, supervision goes on.
#
# ``database or disk is full`` from a journal write used to end the supervisor, whose ``finally``
# then killed the healthy worker. ``ResilientJournal`` drops a memory sample that cannot be written
# and keeps a fact that matters (a transition, an attempt's start or end, an event) in memory, to be
# written in order once the disk takes writes again; meanwhile one write every ``PROBE_EVERY`` seconds
# tries. ``Degradations``: any of our own bookkeeping failing (journal, logs, dashboard, hooks,
# sampler), said once when it starts and once when it ends, kept for ``oomguard status``.


@dataclass
class Problem:
    component: str  # "journal", "log", "web", "hooks", "sampling", "output"
    message: str  # the first failure, e.g. "database or disk is full"
    since: float  # wall clock, for people
    lost: int = 0  # writes, samples or bytes dropped while degraded
    unit: str = "writes"  # what ``lost`` counts
    said: bool = True  # logged (a relapse soon after a recovery is not said again)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "said"}


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
        return error.strerror + (f" ({error.filename})" if error.filename else "")
    return str(error) or type(error).__name__


T = TypeVar("T")
P = ParamSpec("P")
PROBE_EVERY = 2.0  # seconds between tries to write while the journal is degraded
RETRIES = 2  # extra tries of an important write before it is queued
RETRY_DELAY = 0.05
MAX_PENDING = 10_000  # important writes kept while degraded; the oldest are dropped past this
COMPONENT = "journal"
_FAILURES = (sqlite3.Error, OSError)


def _guarded(write: Callable[Concatenate[Journal, P], T], default: T, keep: bool = True
             ) -> Callable[Concatenate[ResilientJournal, P], T]:
    """A ``ResilientJournal`` method: ``write`` (the ``Journal``'s) through ``_guard``."""

    def guarded(self: ResilientJournal, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._guard(functools.partial(write, self, *args, **kwargs), default, keep)

    return guarded


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
        if self.degradations.recovered(COMPONENT) is not None or self.degradations.history:
            for problem in self.degradations.drain():
                self._try(functools.partial(super().event, "degraded", None, **problem.as_dict(), until=time.time()), 0)
        return True

    def _guard(self, write: Callable[[], T], default: T, keep: bool = True) -> T:
        """A write now; else, for a fact that must reach the journal (``keep``), in order once it can
        be written, and for one that may be lost (a memory sample, downsampling), dropped."""
        if self._may_write() and self._flush():
            ok, value = self._try(write, RETRIES if keep and not self.degradations.is_degraded(COMPONENT) else 0)
            if ok:
                self._flush()  # a recovery noticed by this write
                return value  # type: ignore[return-value]
        if not keep:
            self.degradations.failed(COMPONENT, "dropping writes", lost=1)
            return default
        self._pending.append(write)
        if len(self._pending) > MAX_PENDING:
            del self._pending[0]
        self.degradations.failed(COMPONENT, "keeping writes in memory", lost=1)
        return default

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

    # --- the writes: Journal's own, through the guard ----------------------------------------

    set_meta = _guarded(Journal.set_meta, None)
    event = _guarded(Journal.event, 0)
    transition = _guarded(Journal.transition, None)
    start_attempt = _guarded(Journal.start_attempt, None)
    end_attempt = _guarded(Journal.end_attempt, None)
    mark_bad = _guarded(Journal.mark_bad, None)
    clear_bad = _guarded(Journal.clear_bad, None)
    record_sample = _guarded(Journal.record_sample, None, keep=False)
    # Not kept: the loop asks again on every scan, so a checkpoint is recorded once writes work.
    checkpoint_seen = _guarded(Journal.checkpoint_seen, False, keep=False)
    thin_samples = _guarded(Journal.thin_samples, 0, keep=False)
