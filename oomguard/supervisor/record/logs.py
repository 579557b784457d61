"""``oomguard logs``: print an attempt's log, or follow the run's output across attempts.

Every attempt's output is tee'd to ``RUN_DIR/logs/attempt-N.log``. ``-f`` keeps printing as the
worker writes, moves on to the next attempt's log when the supervisor starts one (with a
``==> attempt-N.log <==`` line, as ``tail`` marks a new file), and ends once the run reaches a
terminal state or its supervisor is gone. Bytes are copied unchanged: the worker's own output
(progress bars, colour codes) is not ours to decode.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.record.attemptlog import CUT_MARKER
from oomguard.supervisor.record.console import say
from oomguard.supervisor.record.journal import Journal, open_existing
from oomguard.supervisor.record.status import supervisor_alive

POLL = 0.2  # seconds between looks at the log and the journal while following
TERMINAL = ("succeeded", "failed", "stopped")
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
        have = f"attempts with logs: {_ranges(known)}" if known else "no attempt has started yet"
        raise UsageError("--attempt", f"attempt {wanted} has no log in {run_dir / 'logs'}", have)
    return wanted


def _ranges(numbers: list[int]) -> str:
    return f"{numbers[0]}-{numbers[-1]}" if len(numbers) > 1 else str(numbers[0])


def copy_new(source: BinaryIO, out: BinaryIO) -> int:
    """Copy what was appended to ``source`` since the last call; bytes copied."""
    total = 0
    while chunk := source.read(_CHUNK):
        out.write(chunk)
        total += len(chunk)
    if total:
        out.flush()
    return total


class LogReader:
    """One attempt's log, read as it grows; a compaction between two looks neither repeats nor
    skips output without saying so.

    With ``--log-max-bytes`` the writer compacts the log in place (``attemptlog.py``): the newest
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
    current = attempt
    source: BinaryIO | None = None
    reader: LogReader | None = None
    try:
        while True:
            why = over()  # asked before reading, so nothing written before the end is missed
            if source is None and current is not None and log_file(run_dir, current).exists():
                source = open(log_file(run_dir, current), "rb")  # closed in finally
                reader = LogReader(source)
            if reader is not None:
                reader.copy_new(out)
            nxt = _next_attempt(run_dir, current)
            if nxt is not None:
                if source is not None:
                    source.close()
                source, reader, current = None, None, nxt
                out.write(f"\n==> {log_file(run_dir, nxt).name} <==\n".encode())
                continue
            if why is not None:
                return why
            time.sleep(poll)
    finally:
        if source is not None:
            source.close()


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
    journal = open_existing(run_dir)
    try:
        attempt = choose_attempt(run_dir, args.attempt)
        out = sys.stdout.buffer
        if not args.follow:
            if attempt is None:
                raise UsageError("--run-dir", f"no attempt has started in {run_dir} yet", "try again with -f")
            with open(log_file(run_dir, attempt), "rb") as source:
                copy_new(source, out)
            return 0
        why = follow(run_dir, attempt, out, run_over(journal))
        say(why)
        return 0
    finally:
        journal.close()


def add_logs_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("logs", help="print an attempt's log; -f follows the run across attempts")
    parser.add_argument("--run-dir", default="oomguard-run", help="the run directory (default: oomguard-run)")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="keep printing, across new attempts, until the run ends (or Ctrl-C)")
    parser.add_argument("--attempt", type=int, default=None, metavar="N",
                        help="the attempt whose log to print (default: the latest)")
    parser.set_defaults(func=_cmd_logs)
