"""Chart markers, kept current without rescanning the whole journal on every request."""

from __future__ import annotations

import threading
from typing import Any

from oomguard.supervisor.record.journal import Journal
from oomguard.web.timeline import attempt_markers, checkpoint_markers, event_marker

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
