"""Cutting the worker's output stream into lines, cheaply and with a bound, as journald does.

The output thread reads the pipe in chunks of whatever is there. ``LineSplitter`` turns them into
lines: ``\\n``, ``\\r\\n`` and a bare ``\\r`` all end a line (a tqdm bar redraws with ``\\r``; each redraw
is progress), and a line longer than ``line_max`` is handed on in pieces (journald's ``LineMax``)
instead of being buffered whole, so one 50 MiB line without a newline costs no more memory than
``line_max``.

What is looked at is bounded per read, not per byte: a read that holds more than ``flood_lines``
lines (or ``recent_bytes`` of them) means the worker writes faster than anyone can look at each line
(a flood, or the reader fell behind), and only its newest lines are handed on: the latest progress,
and the tail where a failure's traceback is. The rest still reaches the log file and the console;
it is only not looked at. Measured on a 2-core box, even one substring search over every byte of a
200 MB flood costs as much CPU as the worker spends writing it, so nothing scans the whole stream.
"""

from __future__ import annotations

import re

LINE_MAX = 48 * 1024  # bytes; journald's default LineMax
FLOOD_LINES = 64  # at most this many lines of one read are handed on (the newest)
RECENT_BYTES = 16 * 1024  # and only from its last this many bytes
OVERLONG_PIECES = 2  # pieces of an overlong line handed on per read (the newest)
_BREAK = re.compile(rb"\r\n|\r|\n")


class LineSplitter:
    """Feed it the chunks read from the pipe; it returns the complete lines to look at."""

    def __init__(self, line_max: int = LINE_MAX, flood_lines: int = FLOOD_LINES,
                 recent_bytes: int = RECENT_BYTES) -> None:
        self.line_max = line_max
        self.flood_lines = flood_lines
        self.recent_bytes = max(recent_bytes, line_max)
        self._partial = b""
        self._after_cr = False  # the last read ended in \r: a \n starting the next one is the same end
        self.lines = 0  # lines handed on
        self.skipped_bytes = 0  # bytes of floods not looked at

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        data = self._partial + chunk if self._partial else chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0:
            self._partial = data
            return self._overlong()
        end = cut - 1 if data[cut - 1:cut + 1] == b"\r\n" else cut
        complete, self._partial = data[:end], data[cut + 1:]
        return self._handed_on(self._newest(complete)) + self._overlong()

    def flush(self) -> list[bytes]:
        """At the end of the stream: the last line, if it had no newline."""
        rest, self._partial = self._partial, b""
        return self._handed_on(_pieces(rest, self.line_max)[-OVERLONG_PIECES:]) if rest else []

    def _newest(self, complete: bytes) -> list[bytes]:
        """The newest lines of ``complete``: all of them, unless it is a flood."""
        start = len(complete) - self.recent_bytes
        if start > 0:  # begin at a line boundary, so no line is handed on cut in half
            start = max(complete.rfind(b"\n", 0, start), complete.rfind(b"\r", 0, start)) + 1
            self.skipped_bytes += start
        recent = complete[start:] if start > 0 else complete
        lines = _BREAK.split(recent) if b"\r" in recent else recent.split(b"\n")
        if len(lines) > self.flood_lines:
            self.skipped_bytes += sum(len(ln) + 1 for ln in lines[:-self.flood_lines])
            lines = lines[-self.flood_lines:]
        return _capped(lines, self.line_max)

    def _overlong(self) -> list[bytes]:
        """A partial line past the cap goes out in pieces of ``line_max`` now (the newest of them)."""
        if len(self._partial) < self.line_max:
            return []
        whole = len(self._partial) - len(self._partial) % self.line_max
        out = _pieces(self._partial[:whole], self.line_max)
        self._partial = self._partial[whole:]
        self.skipped_bytes += sum(len(p) for p in out[:-OVERLONG_PIECES])
        return self._handed_on(out[-OVERLONG_PIECES:])

    def _handed_on(self, lines: list[bytes]) -> list[bytes]:
        self.lines += len(lines)
        return lines


def _pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def _capped(lines: list[bytes], line_max: int) -> list[bytes]:
    if all(len(ln) <= line_max for ln in lines):
        return lines
    return [piece for ln in lines for piece in (_pieces(ln, line_max) if len(ln) > line_max else [ln])]
