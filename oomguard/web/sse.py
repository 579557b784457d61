"""Live updates: from ``Supervisor.listeners`` (the loop's thread) to server-sent-event streams.

Tested in tests/e2e/web/test_web_browser.py and tests/e2e/web/test_web_api.py (live updates).

The journal is the source of truth; a stream sends what the journal gained since it last looked
(events by id, samples by time). The listener only *wakes* the streams: it schedules
``asyncio.Event.set`` on the server's event loop and returns, so it costs the supervision loop a
few microseconds however many clients there are and however slow they read. Nothing is queued
per client, so memory stays bounded; a client that falls behind simply gets the next batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from anyio import to_thread

from oomguard.supervisor.record.status import status_document
from oomguard.web import exposure as redact
from oomguard.web.journals import JournalPool, JournalUnavailable, last_event_id
from oomguard.web.timeline import chart_point

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
    start = since if since is not None else last_event_id(pool.get())
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
