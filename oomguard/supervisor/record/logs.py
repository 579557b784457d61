"""``oomguard logs``: print an attempt's log, or follow the run's output across attempts.

Every attempt's output is tee'd to ``RUN_DIR/logs/attempt-N.log``. ``-f`` keeps printing as the
worker writes, moves on to the next attempt's log when the supervisor starts one (with a
``==> attempt-N.log <==`` line, as ``tail`` marks a new file), and ends once the run reaches a
terminal state or its supervisor is gone. Bytes are copied unchanged: the worker's own output
(progress bars, colour codes) is not ours to decode. Also here: one attempt's log file (buffered,
capped, never the reason the worker stops), and the supervisor's own messages through one path, the
stdlib logger ``oomguard`` (tested in tests/e2e/test_supervisor.py, what a real run prints).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path
from typing import BinaryIO

from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.record.journal import Degradations, Journal, open_existing
from oomguard.supervisor.record.picture import TERMINAL, supervisor_alive

# The supervisor's own messages: one path, the stdlib logger ``oomguard``.
#
# Every part says what it has to say through ``say`` (or ``logging.getLogger(__name__)`` under
# ``oomguard.``); where it lands is the handler's business: stderr with an ``[oomguard]`` prefix by
# default, the terminal status line when one is shown (``ops.hooks``), whatever a host program
# configures otherwise. The worker's own output never goes through here: it is bytes, echoed as they
# come.

LOGGER = logging.getLogger("oomguard")


class _Stderr(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (pytest and the CLI swap it), flushed per line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"[oomguard] {self.format(record)}", file=sys.stderr, flush=True)
        except Exception:  # a closed stderr must not stop supervision
            self.handleError(record)


def _ensure_handler() -> None:
    if not LOGGER.handlers:
        LOGGER.addHandler(_Stderr())
        LOGGER.setLevel(logging.INFO)
        LOGGER.propagate = False  # one copy of each line, whatever the root logger does


def say(message: str) -> None:
    _ensure_handler()
    LOGGER.info(message)


def show_through(handler: logging.Handler) -> None:
    """Send every message to ``handler`` instead of stderr (the status line redraws around them)."""
    _ensure_handler()
    for old in list(LOGGER.handlers):
        LOGGER.removeHandler(old)
    LOGGER.addHandler(handler)


def reset() -> None:
    """Back to stderr (after the status line closes)."""
    show_through(_Stderr())


# One attempt's log file: buffered, capped, and never the reason the worker stops.
#
# The output thread hands every chunk it reads from the worker's pipe to ``AttemptLog.write``. Writes
# are buffered (one ``write()`` per ``BUFFER`` bytes or per ``flush()``, not one per line). With
# ``--log-max-bytes`` the file keeps the head of the attempt (half the cap: how it started, the
# configuration it printed) and its tail (where an OOM or a traceback is), with a marker line where
# the middle was cut; the tail is compacted in place so the file never grows past the cap.
#
# When the disk is full (or any write fails) the bytes are dropped (the newest ``BUFFER`` bytes wait
# for the next try), the ``log`` degradation is said once, and a write is tried again every
# ``PROBE_EVERY`` seconds; the output thread keeps draining
# the pipe all the while, so the worker never blocks on its own ``print``. Once writing works again
# a line in the log says how much was lost.


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
        # One byte more than the quarter: the tail starts after a newline, with a whole line (a line
        # longer than the quarter is kept as its end).
        newest = os.pread(self._fd, quarter + 1, self._size - quarter - 1)
        newest = newest[max(newest.find(b"\n"), 0) + 1:]
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


POLL = 0.2  # seconds between looks at the log and the journal while following
_LOG_NAME = re.compile(r"^attempt-(\d+)\.log$")
_CHUNK = 1 << 16
SEEN = 4096  # bytes of what was printed last, kept to find our place again in a compacted log
GAP = b"\n[oomguard] ... part of the output was cut (--log-max-bytes) before it could be printed ...\n"


def log_file(run_dir: Path, attempt: int) -> Path:
    return run_dir / "logs" / f"attempt-{attempt}.log"


def attempts_with_logs(run_dir: Path) -> list[int]:
    """Attempt numbers that have a log file, in order."""
    folder = run_dir / "logs"
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _LOG_NAME.match(p.name)))


def choose_attempt(run_dir: Path, wanted: int | None) -> int | None:
    """The attempt to show: ``wanted`` if it has a log, else the latest; None when no attempt has
    started yet. A ``wanted`` attempt without a log is the user's mistake."""
    known = attempts_with_logs(run_dir)
    if wanted is None:
        return known[-1] if known else None
    if wanted < 1:
        raise UsageError("--attempt", f"{wanted} is not an attempt number", "attempts count from 1")
    if wanted not in known:
        ranges = f"{known[0]}-{known[-1]}" if len(known) > 1 else str(known[0]) if known else ""
        have = f"attempts with logs: {ranges}" if known else "no attempt has started yet"
        raise UsageError("--attempt", f"attempt {wanted} has no log in {run_dir / 'logs'}", have)
    return wanted


class LogReader:
    """One attempt's log, read as it grows; a compaction between two looks neither repeats nor
    skips output without saying so.

    With ``--log-max-bytes`` the writer compacts the log in place (``AttemptLog`` above): the newest
    part of the tail moves down to where the cut is, so our offset no longer points after what we
    printed. We notice because the bytes just before our offset stop matching the last ones we
    printed, and find our place again by searching the tail for them. If the writer dropped them
    before we read on (a burst bigger than the cap between two looks), one line says so and we go
    on from the oldest byte still kept.
    """

    def __init__(self, source: BinaryIO) -> None:
        self.source = source
        self.pos = 0
        self.seen = b""

    def copy_new(self, out: BinaryIO) -> int:
        """Copy what was appended since the last call (the whole log at the first); bytes copied."""
        self._find_our_place(out)
        self.source.seek(self.pos)
        total = 0
        while chunk := self.source.read(_CHUNK):
            out.write(chunk)
            total += len(chunk)
            self.seen = (self.seen + chunk)[-SEEN:]  # what was printed, not what the file holds by now
        self.pos += total
        if total:
            out.flush()
        return total

    def _find_our_place(self, out: BinaryIO) -> None:
        if not self.seen:
            return
        self.source.seek(self.pos - len(self.seen))
        if self.source.read(len(self.seen)) == self.seen:
            return
        self.source.seek(0)
        data = self.source.read()
        cut = data.find(CUT_MARKER)
        tail = cut + len(CUT_MARKER) if cut >= 0 else 0
        # The first match in the tail: should the output repeat itself exactly, print again rather
        # than skip. A small cap keeps less than SEEN bytes of the tail: try shorter ends of it.
        for size in (SEEN, 1024, 256, 64):
            needle = self.seen[-size:]
            if (at := data.find(needle, tail)) >= 0:
                self.pos = at + len(needle)
                return
        out.write(GAP)
        self.pos = tail


def run_over(journal: Journal) -> Callable[[], str | None]:
    """A check for the end of following: returns why (state and reason) once the run is over."""

    def over() -> str | None:
        meta = journal.meta()
        state = meta.get("state")
        if state in TERMINAL:
            return f"run {state}: {meta.get('reason', '')}"
        if not supervisor_alive(meta):
            return f"the supervisor is not running (last state: {state or 'unknown'})"
        return None

    return over


def follow(run_dir: Path, attempt: int | None, out: BinaryIO, over: Callable[[], str | None],
           poll: float = POLL) -> str:
    """Print ``attempt``'s log and every later one as it grows until ``over()`` says why to stop."""
    current, reader = attempt, None
    try:
        while True:
            why = over()  # asked before reading, so nothing written before the end is missed
            if reader is None and current is not None and log_file(run_dir, current).exists():
                reader = LogReader(open(log_file(run_dir, current), "rb"))  # closed in finally
            if reader is not None:
                reader.copy_new(out)
            nxt = _next_attempt(run_dir, current)
            if nxt is not None:
                if reader is not None:
                    reader.source.close()
                reader, current = None, nxt
                out.write(f"\n==> {log_file(run_dir, nxt).name} <==\n".encode())
                continue
            if why is not None:
                return why
            time.sleep(poll)
    finally:
        if reader is not None:
            reader.source.close()


def _next_attempt(run_dir: Path, current: int | None) -> int | None:
    """The attempt after ``current`` once its log exists (the first one when none had started)."""
    if current is None:
        known = attempts_with_logs(run_dir)
        return known[0] if known else None
    return current + 1 if log_file(run_dir, current + 1).exists() else None


def _cmd_logs(args: argparse.Namespace, command: Sequence[str]) -> int:
    if command:
        raise UsageError("logs", "takes no command after --",
                         f"run: oomguard logs --run-dir {shlex.quote(str(args.run_dir))}")
    run_dir = Path(args.run_dir)
    with closing(open_existing(run_dir)) as journal:
        attempt = choose_attempt(run_dir, args.attempt)
        out = sys.stdout.buffer
        if not args.follow:
            if attempt is None:
                raise UsageError("--run-dir", f"no attempt has started in {run_dir} yet", "try again with -f")
            with open(log_file(run_dir, attempt), "rb") as source:
                LogReader(source).copy_new(out)
            return 0
        say(follow(run_dir, attempt, out, run_over(journal)))
        return 0


def add_logs_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("logs", help="print an attempt's log; -f follows the run across attempts")
    parser.add_argument("--run-dir", default="oomguard-run", help="the run directory (default: oomguard-run)")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="keep printing, across new attempts, until the run ends (or Ctrl-C)")
    parser.add_argument("--attempt", type=int, default=None, metavar="N",
                        help="the attempt whose log to print (default: the latest)")
    parser.set_defaults(func=_cmd_logs)
