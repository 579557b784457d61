"""One supervisor per run directory: an exclusive flock held for the supervisor's lifetime.

The kernel drops the lock when the process dies, ``kill -9`` included, so a stale lock file never
blocks the next start.
"""

from __future__ import annotations

import fcntl
import os
import shlex
from pathlib import Path

from oomguard.supervisor.errors import UsageError


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "supervisor.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UsageError("--run-dir", f"{self.path.parent} is already supervised by pid {holder}",
                             f"stop that supervisor (oomguard stop --run-dir {shlex.quote(str(self.path.parent))}) "
                             "or choose another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
