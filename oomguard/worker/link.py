"""Talking to the supervisor through ``common/protocol.py``: records out, requests in.

Out: progress, heartbeats, batch changes, checkpoints and failures, appended to the
``OOMGUARD_EVENTS`` file (a no-op without a supervisor). In: a checkpoint request (the signal
named by ``OOMGUARD_CHECKPOINT_SIGNAL`` and/or the file ``OOMGUARD_CHECKPOINT_REQUEST``) and a
stop (SIGTERM, SIGINT). Signal handlers only set flags; the session acts at the next step
boundary, where the state is consistent.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

from oomguard.common import protocol


class Channel:
    """Records for the supervisor, with progress rate-limited and heartbeats in between."""

    def __init__(self, progress_every_s: float = 1.0, heartbeat_every_s: float = 10.0) -> None:
        self.progress_every_s = progress_every_s
        self.heartbeat_every_s = heartbeat_every_s
        self._last_progress = float("-inf")
        self._last_record = time.monotonic()

    def progress(self, step: int, *, force: bool = False, **fields: Any) -> None:
        now = time.monotonic()
        if force or now - self._last_progress >= self.progress_every_s:
            self._emit(protocol.PROGRESS, step=step, **fields)
            self._last_progress = now

    def heartbeat(self, step: int) -> None:
        """Called inside long steps (per micro-batch) so a slow step is not taken for a hang."""
        if time.monotonic() - self._last_record >= self.heartbeat_every_s:
            self._emit(protocol.HEARTBEAT, step=step)

    def batch(self, micro_batch: int, grad_accum: int, reason: str, **fields: Any) -> None:
        self._emit(protocol.BATCH, micro_batch=micro_batch, grad_accum=grad_accum, reason=reason, **fields)

    def checkpoint(self, path: str, step: int) -> None:
        self._emit(protocol.CHECKPOINT, path=path, step=step)

    def failure(self, kind: str, message: str, micro_batch: int | None, **fields: Any) -> None:
        self._emit(protocol.FAILURE, kind=kind, message=message, micro_batch=micro_batch, **fields)

    def _emit(self, record_type: str, **fields: Any) -> None:
        protocol.emit(record_type, **fields)
        self._last_record = time.monotonic()


class Requests:
    """Flags set by signals, read at step boundaries; installs and later restores the handlers."""

    def __init__(self) -> None:
        self.stop_signal: int | None = None
        self._checkpoint_flag = False
        self.request_file = os.environ.get(protocol.ENV_CHECKPOINT_REQUEST) or None
        self._checkpoint_signal = protocol.signal_number(os.environ.get(protocol.ENV_CHECKPOINT_SIGNAL, ""))
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Install the handlers (main thread only; elsewhere Python forbids it and we poll the file)."""
        wanted: dict[int, Any] = {signal.SIGTERM: self._on_stop, signal.SIGINT: self._on_stop}
        if self._checkpoint_signal is not None:
            wanted[self._checkpoint_signal] = self._on_checkpoint
        for signum, handler in wanted.items():
            try:
                self._previous[signum] = signal.signal(signum, handler)
            except ValueError:
                return  # not the main thread

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def checkpoint_wanted(self) -> bool:
        # The file is checked too: it survives a signal that arrived before the handler existed.
        return self._checkpoint_flag or (self.request_file is not None and os.path.exists(self.request_file))

    def checkpoint_done(self) -> None:
        self._checkpoint_flag = False
        if self.request_file is not None:
            Path(self.request_file).unlink(missing_ok=True)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is not None:
            # A second SIGTERM/SIGINT means "now": do not wait for the step to end. Checkpoints
            # are atomic, so dying mid-write loses nothing but the write.
            os._exit(128 + signum)
        self.stop_signal = signum

    def _on_checkpoint(self, signum: int, frame: FrameType | None) -> None:
        self._checkpoint_flag = True
