"""What the loop learns about one attempt while it runs: progress, checkpoints, hangs, peaks.

``AttemptWatch`` folds the worker's structured records (``worker.protocol``) and the output
scanner's evidence into facts the loop and the policy read: the last step, whether a checkpoint
landed, whether the worker reported its own failure, and how long it has been quiet. It does no I/O;
the loop feeds it records and readings and carries out what follows from them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from oomguard.supervisor.observe.memory import AttemptPeak
from oomguard.supervisor.observe.output import OutputScanner
from oomguard.worker import protocol

PROGRESS_EVENT_EVERY = 10.0  # progress records are journaled as events at most this often
REQUEST_COOLDOWN = 60.0  # seconds between two checkpoint requests for memory
_ALIVE = (protocol.PROGRESS, protocol.HEARTBEAT, protocol.CHECKPOINT, protocol.BATCH)


@dataclass
class AttemptWatch:
    """What the loop learns while one attempt runs."""

    scanner: OutputScanner = field(default_factory=OutputScanner)
    last_progress: float = field(default_factory=time.monotonic)
    progress_records: int = 0
    last_step: int | None = None
    new_checkpoint: bool = False
    worker_failure: dict[str, Any] | None = None
    stopped_for_memory: str | None = None
    hung: str | None = None
    peak: AttemptPeak | None = None
    progress: dict[str, Any] | None = None  # the newest progress record, written with the next sample
    last_progress_event: float = -PROGRESS_EVENT_EVERY
    started: float = field(default_factory=time.monotonic)
    last_request: float = -REQUEST_COOLDOWN
    grow_to: int | None = None  # --grow: restart at this micro-batch once the next checkpoint lands
    growing: bool = False  # the worker was stopped to grow

    @property
    def peak_rss(self) -> int:
        return self.peak.worker_rss_bytes if self.peak else 0

    def take(self, record: dict[str, Any], now: float) -> bool:
        """Fold one worker record in; True when it should be journaled as an event. Progress
        records are many: the meta and the attempt's last step carry them, events stay few."""
        kind = record["type"]
        if kind in _ALIVE:
            self.last_progress = now
        if kind == protocol.PROGRESS:
            self.progress_records += 1
            self.last_step = record.get("step", self.last_step)
            self.progress = record
            if now - self.last_progress_event < PROGRESS_EVENT_EVERY:
                return False
            self.last_progress_event = now
        elif kind == protocol.FAILURE:
            self.worker_failure = record
        return kind != protocol.HEARTBEAT

    def hang_reason(self, last_output: float, timeout: float, now: float) -> str | None:
        """Why the worker counts as hung (once), or None: no output and no progress for ``timeout``."""
        quiet = now - max(last_output, self.last_progress)
        if timeout <= 0 or quiet < timeout or self.hung:
            return None
        return f"no output or progress for {quiet:.0f} s (--hang-timeout {timeout:g})"

    def request_pending(self, request_file_exists: bool, now: float) -> bool:
        """A checkpoint request already written and still fresh is not repeated."""
        return request_file_exists and now - self.last_request < REQUEST_COOLDOWN
