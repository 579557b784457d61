"""The output thread: drains the worker's pipe, whatever else fails.

A worker blocks on ``print`` as soon as nobody reads its pipe, and a blocked worker looks hung. So
this thread's one duty is to keep reading: it reads chunks with ``os.read`` (no line buffering, no
waiting for a newline), and hands each chunk to the log (buffered, capped, degrading on a full
disk), to the console, and to ``LineSplitter`` for the lines worth looking at. Any of those failing
is reported as a degradation and the reading goes on; a read that times out flushes the log, so a
quiet worker's last lines still reach the file.
"""

from __future__ import annotations

import fcntl
import os
import select
import time
from collections.abc import Callable

from oomguard.supervisor.observe.lines import LineSplitter
from oomguard.supervisor.record.attemptlog import AttemptLog
from oomguard.supervisor.record.degraded import Degradations

READ_SIZE = 1 << 20  # the pipe is widened to this where the kernel allows (pipe-max-size is 1 MiB by default)
FLUSH_EVERY = 0.25  # seconds of silence after which the log buffer is written out


class OutputPump:
    def __init__(self, fd: int, log: AttemptLog, echo: Callable[[bytes], None] | None,
                 on_line: Callable[[str], None], problems: Degradations | None = None) -> None:
        self.fd = fd
        self.log = log
        self.echo = echo
        self.on_line = on_line
        self.problems = problems
        self.splitter = LineSplitter()
        _widen(fd)
        self.last_output = time.monotonic()  # any byte counts: a \r progress bar is output
        self.bytes = 0
        self._flushed = time.monotonic()

    def run(self) -> None:
        try:
            while self._step():
                pass
            self._lines(self.splitter.flush())
        finally:
            self._guard("log", self.log.close)

    def _step(self) -> bool:
        """One read; False at the end of the stream."""
        try:
            ready, _, _ = select.select([self.fd], [], [], FLUSH_EVERY)
            if not ready:
                self._flush()
                return True
            chunk = os.read(self.fd, READ_SIZE)
        except InterruptedError:
            return True
        except OSError as exc:  # the pipe itself is broken: nothing more will come
            self._report("output", exc)
            return False
        if not chunk:
            return False
        self.last_output = time.monotonic()
        self.bytes += len(chunk)
        self._guard("log", self.log.write, chunk)
        if self.last_output - self._flushed >= FLUSH_EVERY:  # a steady trickle is written out too
            self._flush()
        self._echo(chunk)
        self._lines(self.splitter.feed(chunk))
        return True

    def _flush(self) -> None:
        self._flushed = time.monotonic()
        self._guard("log", self.log.flush)

    def _lines(self, lines: list[bytes]) -> None:
        for raw in lines:
            self._guard("output", self.on_line, raw.decode("utf-8", "replace"))

    def _echo(self, chunk: bytes) -> None:
        if self.echo is None:
            return
        try:
            self.echo(chunk)
        except (OSError, ValueError):  # the terminal went away; supervision goes on
            self.echo = None

    def _guard(self, component: str, action: Callable[..., object], *args: object) -> None:
        try:
            action(*args)
        except Exception as exc:  # a bug or a full disk here must not stop the draining
            self._report(component, exc)

    def _report(self, component: str, exc: BaseException) -> None:
        if self.problems is not None:
            self.problems.failed(component, exc)


def _widen(fd: int) -> None:
    """A 1 MiB pipe instead of 64 KiB: a flooding worker blocks 16× less often, and each wake-up of
    this thread takes 16× more (the per-read cost is what limits throughput)."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), READ_SIZE)
    except OSError:  # an unprivileged user past pipe-user-pages-soft: 64 KiB still works
        return
