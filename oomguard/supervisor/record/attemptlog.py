"""One attempt's log file: buffered, capped, and never the reason the worker stops.

The output thread hands every chunk it reads from the worker's pipe to ``AttemptLog.write``. Writes
are buffered (one ``write()`` per ``BUFFER`` bytes or per ``flush()``, not one per line). With
``--log-max-bytes`` the file keeps the head of the attempt (half the cap: how it started, the
configuration it printed) and its tail (where an OOM or a traceback is), with a marker line where
the middle was cut; the tail is compacted in place so the file never grows past the cap.

When the disk is full (or any write fails) the bytes are dropped (the newest ``BUFFER`` bytes wait
for the next try), the ``log`` degradation is said once, and a write is tried again every
``PROBE_EVERY`` seconds; the output thread keeps draining
the pipe all the while, so the worker never blocks on its own ``print``. Once writing works again
a line in the log says how much was lost.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from oomguard.supervisor.record.degraded import Degradations

BUFFER = 1 << 20  # bytes kept before a write()
PROBE_EVERY = 2.0  # seconds between tries while the disk is full
COMPONENT = "log"
CUT_MARKER = b"\n[oomguard] ... output cut here (--log-max-bytes keeps the head and the tail of each attempt) ...\n"


def open_log(path: Path) -> int:
    """Open for appending, never through a symlink someone planted in the run directory."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


class AttemptLog:
    def __init__(self, path: Path, max_bytes: int | None = None, problems: Degradations | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.problems = problems
        self._fd: int | None = None
        self._buffer = bytearray()
        self._size = 0
        self._cut_at: int | None = None  # where the tail region starts once the head is full
        self._lost = 0
        self._next_probe = 0.0
        self._open()

    def _open(self) -> None:
        try:
            self._fd = open_log(self.path)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            self._fail(exc, 0)

    def write(self, data: bytes) -> None:
        if not self._buffer and not self._lost and len(data) >= BUFFER // 4:
            self._write_out(data)  # a big read: written as it is rather than copied twice
            return
        self._buffer += data
        if len(self._buffer) >= BUFFER:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        if self._lost and not self._probe_due():
            # Degraded: the newest BUFFER bytes wait for the next try (where a failure's traceback is).
            if (excess := len(self._buffer) - BUFFER) > 0:
                del self._buffer[:excess]
                self._lost += excess
            return
        data, self._buffer = bytes(self._buffer), bytearray()
        self._write_out(data)

    def _write_out(self, data: bytes) -> None:
        if self._fd is None:
            self._open()
            if self._fd is None:
                self._lost += len(data)
                return
        try:
            if self._lost:
                self._raw(f"\n[oomguard] {self._lost} bytes of output were lost: the log could not be "
                          "written\n".encode())
                self._lost = 0
                if self.problems is not None:
                    self.problems.recovered(COMPONENT)
            self._store(data)
        except OSError as exc:
            self._fail(exc, len(data))

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # --- the cap ------------------------------------------------------------------------------

    def _store(self, data: bytes) -> None:
        if self.max_bytes is None:
            self._raw(data)
            return
        head = self.max_bytes // 2
        if self._cut_at is None:
            room = max(0, head - self._size)
            if len(data) > room and (newline := data.rfind(b"\n", 0, room)) >= 0:
                room = newline + 1  # the cut between two lines, not through one
            self._raw(data[:room])
            if len(data) <= room:
                return
            self._raw(CUT_MARKER)
            self._cut_at, data = self._size, data[room:]
        self._raw(data)
        self._compact()

    def _compact(self) -> None:
        """Keep at least a quarter of the cap as the tail: past half the cap, move the newest quarter
        down to where the tail starts (so the file stays within the cap)."""
        assert self._fd is not None and self._cut_at is not None and self.max_bytes is not None
        quarter = max(1, self.max_bytes // 4)
        if self._size - self._cut_at <= 2 * quarter:
            return
        # One byte more than the quarter: the tail starts after a newline, with a whole line.
        newest = os.pread(self._fd, quarter + 1, self._size - quarter - 1)
        if (newline := newest.find(b"\n")) >= 0:
            newest = newest[newline + 1:]
        else:
            newest = newest[1:]  # one line longer than the quarter: kept as its end
        os.ftruncate(self._fd, self._cut_at)  # O_APPEND: the next write lands at the new end
        self._size = self._cut_at
        self._raw(newest)

    # --- writing and failing ------------------------------------------------------------------

    def _raw(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            self._size += n
            view = view[n:]

    def _probe_due(self) -> bool:
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + PROBE_EVERY
        return True

    def _fail(self, exc: OSError, lost: int) -> None:
        self._lost += max(lost, 1)
        self._next_probe = time.monotonic() + PROBE_EVERY
        if self.problems is not None:
            self.problems.failed(COMPONENT, exc, lost=lost, what=f" (writing {self.path})", unit="bytes")
