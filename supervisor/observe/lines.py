"""Cutting the worker's output stream into lines, cheaply and with a bound, as journald does.

The output thread reads the pipe in chunks of whatever is there. ``LineSplitter`` turns them into
lines: ``\\n``, ``\\r\\n`` and a bare ``\\r`` all end a line (a tqdm bar redraws with ``\\r``; each redraw
is progress), and a line longer than ``line_max`` is handed on in pieces (journald's ``LineMax``)
instead of being buffered whole, so one 50 MiB line without a newline costs no more memory than
``line_max``.

A read that holds more than ``flood_lines`` lines means the worker writes faster than anyone can
look at each line (a flood, or the reader fell behind). Then only the lines that can matter are
handed on: those ``wanted`` says may be evidence (a cheap substring test over the whole read
first) and the newest ``flood_lines`` lines (the latest progress, the tail before a crash). The
rest still reaches the log file and the console; it is only not looked at.
"""

from __future__ import annotations

import re
from collections.abc import Callable

LINE_MAX = 48 * 1024  # bytes; journald's default LineMax
FLOOD_LINES = 64  # lines in one read past which only wanted and newest lines are handed on
_BREAK = re.compile(rb"\r\n|\r|\n")


class LineSplitter:
    """Feed it the chunks read from the pipe; it returns the complete lines to look at."""

    def __init__(self, wanted: Callable[[bytes], bool], line_max: int = LINE_MAX,
                 flood_lines: int = FLOOD_LINES) -> None:
        self.wanted = wanted
        self.line_max = line_max
        self.flood_lines = flood_lines
        self._partial = b""
        self.lines = 0  # lines seen, handed on or not
        self.skipped = 0  # lines of floods not handed on

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._partial + chunk if self._partial else chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0:
            self._partial = data
            return self._overlong()
        complete, self._partial = data[:cut], data[cut + 1:]
        lines = self._lines(complete)
        return lines + self._overlong()

    def flush(self) -> list[bytes]:
        """At the end of the stream: the last line, if it had no newline."""
        rest, self._partial = self._partial, b""
        if not rest:
            return []
        self.lines += 1
        return _pieces(rest, self.line_max)

    def _overlong(self) -> list[bytes]:
        """A partial line past the cap goes out in pieces of ``line_max`` now."""
        if len(self._partial) < self.line_max:
            return []
        whole = len(self._partial) - len(self._partial) % self.line_max
        out = _pieces(self._partial[:whole], self.line_max)
        self._partial = self._partial[whole:]
        self.lines += len(out)
        if len(out) > self.flood_lines:
            self.skipped += len(out) - self.flood_lines
            return [p for p in out[:-self.flood_lines] if self.wanted(p)] + out[-self.flood_lines:]
        return out

    def _lines(self, complete: bytes) -> list[bytes]:
        count = complete.count(b"\n") + complete.count(b"\r") + 1  # an upper bound: \r\n counts twice
        if count <= self.flood_lines:
            lines = _capped(_BREAK.split(complete), self.line_max)
            self.lines += len(lines)
            return lines
        # A flood: split only the end of it, and the rest only if something in it is wanted.
        self.lines += count
        end = len(complete) - self.flood_lines * 512
        at = max(complete.rfind(b"\n", 0, end), complete.rfind(b"\r", 0, end)) if end > 0 else -1
        head, recent = (complete[:at], complete[at + 1:]) if at >= 0 else (b"", complete)
        newest = _capped(_BREAK.split(recent), self.line_max)[-self.flood_lines:]
        picked = [ln for ln in _capped(_BREAK.split(head), self.line_max) if self.wanted(ln)] \
            if head and self.wanted(head) else []
        self.skipped += max(0, count - len(newest) - len(picked))
        return picked + newest


def _pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def _capped(lines: list[bytes], line_max: int) -> list[bytes]:
    if all(len(ln) <= line_max for ln in lines):
        return lines
    return [piece for ln in lines for piece in (_pieces(ln, line_max) if len(ln) > line_max else [ln])]
