"""What the world asks of the loop: signals, and the dashboard's or the CLI's requests.

Tested in tests/unit/supervisor/ops/test_systemd.py and tests/e2e/test_operator.py.

Signal handlers and the web server's threads only set a flag here and wake the loop (uvicorn's
rule); the loop reads the flags at its next tick and acts. A second SIGINT/SIGTERM forces the stop:
the worker's grace period is cut short.

Also here:

- One supervisor per run directory: an exclusive flock held for the supervisor's lifetime.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import threading
from pathlib import Path
from types import FrameType

from oomguard.supervisor.errors import UsageError


class ControlFlags:
    def __init__(self) -> None:
        self.wake = threading.Event()
        self.stop_signals = 0  # SIGINT/SIGTERM count; the second forces an immediate kill
        self.stop_signal: int | None = None
        self._requests: set[str] = set()
        self._lock = threading.Lock()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signals += 1
        self.stop_signal = signum
        self.wake.set()

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.wake.set()  # not fatal: a closed terminal must not end an overnight run

    def request_stop(self) -> None:
        self._on_stop_signal(signal.SIGTERM, None)

    def request(self, what: str) -> None:
        """``restart`` or ``checkpoint``: taken by the loop at its next tick."""
        with self._lock:
            self._requests.add(what)
        self.wake.set()

    def take(self, what: str) -> bool:
        """True once for each request made since the last time it was taken."""
        with self._lock:
            if what in self._requests:
                self._requests.discard(what)
                return True
            return False

    @property
    def stopping(self) -> bool:
        return self.stop_signals > 0

    @property
    def forced(self) -> bool:
        """A second stop signal: do not wait for the worker's grace period."""
        return self.stop_signals > 1

    def sleep(self, seconds: float) -> None:
        """Wait for a wake-up or ``seconds``, whichever comes first."""
        self.wake.wait(seconds)
        self.wake.clear()


# One supervisor per run directory: an exclusive flock held for the supervisor's lifetime.
#
# The kernel drops the lock when the process dies, ``kill -9`` included, so a stale lock file never
# blocks the next start.


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
