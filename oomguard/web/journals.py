"""The dashboard's reads of the journal: read-only connections, one per thread; what the memory
chart draws; and the live stream of what the journal gained.

Tested in tests/unit/web/test_journals.py, tests/e2e/web/test_web_api.py and
tests/e2e/web/test_web_browser.py.

The supervisor's own ``Journal`` serialises its users with a lock; if request threads shared it, a
slow query would hold up the loop's next write. Each web thread instead opens its own read-only
connection (SQLite WAL: readers never block the writer) and keeps it. A kept connection must never
serve an old snapshot: under WAL, one with a statement left open stays inside its read transaction
(``/metrics`` once served step 100 for 30 s while the run went on), so each hand-out checks that a
connection whose journal files changed since it last looked also saw a commit (``PRAGMA
data_version``), and replaces one that did not.

The chart's helpers are pure functions over journal rows. Sample rows have grown over time
(``rss``/``cgroup_usage`` from the core loop; ``worker_rss_bytes``, ``gpu_used_bytes`` and a
per-device ``gpus`` list from the memory sampler); ``chart_point`` accepts every form.

Live updates go from ``Supervisor.listeners`` (the loop's thread) to server-sent-event streams: a
stream sends what the journal gained since it last looked (events by id, samples by time). The
listener only *wakes* the streams (``asyncio.Event.set`` scheduled on the server's loop), so it
costs the loop a few microseconds however many clients there are; nothing is queued per client, so
memory stays bounded, and a client that falls behind simply gets the next batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anyio import to_thread

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


# What the memory chart draws.

MEMORY_KINDS = frozenset({"cuda_oom", "host_oom", "memory_limit"})


def _first(row: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return int(value)
    return None


def _gpus(row: dict[str, Any]) -> dict[str, int]:
    """GPU memory used per device index (as a string, so it is a JSON object key)."""
    devices = row.get("gpus")
    if isinstance(devices, list):
        out: dict[str, int] = {}
        for pos, dev in enumerate(devices):
            if isinstance(dev, dict):
                used = _first(dev, "worker_bytes", "used_bytes", "used")
                index = dev.get("cuda_index", dev.get("index", pos))
                if used is not None:
                    out[str(index)] = used
        return out
    used = _first(row, "gpu_worker_bytes", "gpu_used_bytes")
    return {} if used is None else {"0": used}


def chart_point(row: dict[str, Any]) -> dict[str, Any]:
    """One sample as the chart draws it: time, attempt, host RSS, cgroup usage, GPU per device."""
    return {
        "t": float(row["t"]),
        "attempt": row.get("attempt"),
        "host_rss": _first(row, "worker_rss_bytes", "rss"),
        "cgroup_usage": _first(row, "cgroup_usage_bytes", "cgroup_usage"),
        "gpu": _gpus(row),
    }


def _peak(point: dict[str, Any]) -> int:
    return max([point["host_rss"] or 0, *point["gpu"].values()])


def downsample(points: Sequence[dict[str, Any]], max_points: int) -> list[dict[str, Any]]:
    """At most ``max_points`` points, keeping each bucket's first, highest and last point.

    Striding (every n-th row) would drop exactly the spikes a person looks for before an OOM.
    Buckets never straddle attempts, so the last sample before each failure survives too.
    """
    if len(points) <= max_points:
        return list(points)
    width = max(1, -(-3 * len(points) // max_points))
    out: list[dict[str, Any]] = []
    start = 0
    while start < len(points):
        attempt = points[start]["attempt"]
        end = start + 1
        while end < min(start + width, len(points)) and points[end]["attempt"] == attempt:
            end += 1
        bucket = points[start:end]
        keep = {0, max(range(len(bucket)), key=lambda i: _peak(bucket[i])), len(bucket) - 1}
        out.extend(bucket[i] for i in sorted(keep))
        start = end
    if len(out) > max_points:  # many short attempts: thin evenly, but keep the newest point
        step = -(-len(out) // max_points)
        out = out[-1::-step][::-1]
    return out


def attempt_markers(attempts: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failures (OOMs apart), restarts and batch changes, from the attempts table."""
    markers: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for row in attempts:
        batch = f"{row['micro_batch']} × {row['grad_accum']}"
        if previous is not None:
            markers.append({"t": row["started"], "kind": "restart", "attempt": row["attempt"],
                            "label": f"attempt {row['attempt']} started at micro-batch {batch}"})
            if row["micro_batch"] != previous["micro_batch"]:
                markers.append({"t": row["started"], "kind": "batch", "attempt": row["attempt"],
                                "label": f"micro-batch {previous['micro_batch']} → {row['micro_batch']}"
                                         f" (accumulation {row['grad_accum']})"})
        if row.get("kind") and row.get("ended"):
            kind = "oom" if row["kind"] in MEMORY_KINDS else "failure"
            markers.append({"t": row["ended"], "kind": kind, "attempt": row["attempt"],
                            "label": f"{row['kind']} at micro-batch {row['micro_batch']}: "
                                     f"{row.get('evidence') or ''}"[:300]})
        previous = row
    return markers


def checkpoint_markers(checkpoints: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"t": c["first_seen"], "kind": "checkpoint", "attempt": c.get("attempt"),
             "label": f"checkpoint step {c['step']}" if c.get("step") is not None else "checkpoint"}
            for c in checkpoints if not c.get("bad")]


def event_marker(event: dict[str, Any]) -> dict[str, Any] | None:
    """A marker for a journal event the tables do not show: the worker changing its own batch."""
    if event["kind"] != "worker_batch":
        return None
    data = event["data"]
    return {"t": event["t"], "kind": "batch", "attempt": event.get("attempt"),
            "label": f"worker set micro-batch {data.get('micro_batch')} × {data.get('grad_accum')}"
                     f" ({data.get('reason', '')})"}

PAGE = 1000
MAX_EVENT_MARKERS = 10_000


class MarkerScan:
    """Attempts and checkpoints are small tables, read each time; events can number millions
    (a progress record per step), so they are scanned once, incrementally, from the last id seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_id = 0
        self._from_events: list[dict[str, Any]] = []

    def markers(self, journal: Journal) -> list[dict[str, Any]]:
        out = attempt_markers(journal.attempts()) + checkpoint_markers(journal.checkpoints())
        out += self._scan(journal)
        return sorted(out, key=lambda m: m["t"])

    def _scan(self, journal: Journal) -> list[dict[str, Any]]:
        with self._lock:
            while events := journal.events(self._last_id, PAGE):
                self._last_id = events[-1]["id"]
                self._from_events += [m for e in events if (m := event_marker(e)) is not None]
            del self._from_events[:-MAX_EVENT_MARKERS]  # bounded: keep the newest
            return list(self._from_events)


# Live updates.

POLL_S = 1.0  # samples are not announced by the loop; look for them this often
KEEPALIVE_S = 15.0  # a comment line so proxies do not close an idle stream
MAX_STREAMS = 64
BATCH = 500


@dataclass(eq=False)
class Subscription:
    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class TooManyStreams(RuntimeError):
    pass


class ChangeBroker:
    """A ``Supervisor`` listener that wakes the live streams. Thread-safe."""

    def __init__(self, max_streams: int = MAX_STREAMS) -> None:
        self.max_streams = max_streams
        self.closed = False
        self.why = "The dashboard server stopped."  # what the streams' last event tells the pages
        self._subs: set[Subscription] = set()
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)

    def __call__(self, name: str, data: dict[str, Any]) -> None:
        self.notify()

    def notify(self) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub.wake.set)
            except RuntimeError:  # the server's loop has closed; the stream is going away
                continue

    def subscribe(self) -> Subscription:
        """Call from the server's event loop."""
        sub = Subscription(asyncio.get_running_loop())
        with self._lock:
            if len(self._subs) >= self.max_streams:
                raise TooManyStreams(f"more than {self.max_streams} live streams")
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)
            self._drained.notify_all()

    def close(self, why: str | None = None) -> None:
        """End every stream (server shutdown), so uvicorn's graceful stop does not wait on them.
        Each sends the final state and an ``end`` event saying ``why`` first."""
        if why is not None and not self.closed:
            self.why = why
        self.closed = True
        self.notify()

    def wait_drained(self, timeout: float) -> bool:
        """Wait until every stream has sent its ``end`` (or ``timeout`` passed): the server keeps
        accepting requests until then, so a page never asks a server that is already gone."""
        with self._drained:
            return self._drained.wait_for(lambda: not self._subs, timeout)


def sse_message(event: str, data: Any, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, default=str)}\n\n".encode()


@dataclass
class Cursor:
    """Where one stream is in the journal."""

    event_id: int
    sample_t: float


def _open_cursor(pool: JournalPool, since: int | None) -> Cursor:
    start = since if since is not None else pool.get().last_event_id()
    return Cursor(start, time.time())


def read_changes(pool: JournalPool, cursor: Cursor) -> list[bytes]:
    """The messages for what the journal gained past ``cursor`` (runs in a worker thread)."""
    journal = pool.get()
    events = journal.events(cursor.event_id, BATCH)
    samples = journal.samples(cursor.sample_t + 1e-6, None, BATCH)
    out = [sse_message("journal", e, e["id"]) for e in events]
    out += [sse_message("sample", chart_point(s)) for s in samples]
    if events:
        cursor.event_id = events[-1]["id"]
        out.append(sse_message("status", redact.status(status_document(journal))))
    if samples:
        cursor.sample_t = samples[-1]["t"]
    return out


Tables = Callable[[], dict[str, Any]]


def _end(broker: ChangeBroker, tables: Tables | None) -> bytes:
    """The last event of a stream whose server is stopping: why, and the tables the page shows (it
    cannot ask for them once the server has gone)."""
    final: dict[str, Any] = {}
    if tables is not None:
        with contextlib.suppress(JournalUnavailable, sqlite3.Error):  # then the page keeps what it has
            final = tables()
    return sse_message("end", {"why": broker.why, **final})


async def stream(pool: JournalPool, broker: ChangeBroker, since: int | None,
                 tables: Tables | None = None) -> AsyncIterator[bytes]:
    """The body of ``GET /api/stream``: a status snapshot, then changes as they happen; when the
    server stops, the final changes and an ``end`` event carrying ``tables()``."""
    sub = broker.subscribe()
    try:
        cursor = await to_thread.run_sync(_open_cursor, pool, since)
        first = await to_thread.run_sync(lambda: redact.status(status_document(pool.get())))
        yield b"retry: 2000\n\n" + sse_message("status", first)
        quiet = 0.0
        while True:
            closing = broker.closed  # read once more after close: the final state goes out too
            messages = await to_thread.run_sync(read_changes, pool, cursor)
            for message in messages:
                yield message
            if closing:
                yield await to_thread.run_sync(_end, broker, tables)
                return
            quiet = 0.0 if messages else quiet + POLL_S
            if quiet >= KEEPALIVE_S:
                quiet = 0.0
                yield b": keepalive\n\n"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sub.wake.wait(), POLL_S)
            sub.wake.clear()
    finally:
        broker.unsubscribe(sub)
