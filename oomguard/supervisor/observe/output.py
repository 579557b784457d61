"""The worker's output, read as it streams: the lines that are evidence of how an attempt ends.

``OutputScanner`` keeps the first line of each kind of evidence and the allocator's figures, so
``decide.classify`` names the failure without re-reading the log. Also here: which phase of
training (evaluation, saving or loading a checkpoint) an attempt was in when it failed.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from oomguard.common import oomtexts

# An allocation failure on the device: the exception's type name (torch >= 1.13; the message after it
# may be anything a custom allocator says), or a library's own text (``oomtexts``).
_DEVICE_OOM = re.compile(r"torch\.(?:cuda\.)?OutOfMemoryError|" + oomtexts.DEVICE_OOM.pattern)
# PyTorch's host allocator failure (seen under RLIMIT_AS or a full machine), Python's own, and NumPy's
# (``numpy._core._exceptions._ArrayMemoryError: Unable to allocate 32.0 TiB for an array ...``).
_HOST_OOM = re.compile(oomtexts.HOST_OOM.pattern + r"|^MemoryError\b|\bMemoryError: |\b_ArrayMemoryError: ")
# A worker that cannot read its checkpoint dies with one of these before making progress.
_LOAD_ERROR = re.compile(
    r"(PytorchStreamReader failed|failed finding central directory|Error\(s\) in loading state_dict"
    r"|UnpicklingError|invalid load key|Ran out of input|BadZipFile|unexpected EOF|EOFError"
    r"|SafetensorError|HeaderTooLarge|checkpoint is (?:corrupt|incomplete|invalid))",
    re.IGNORECASE,
)
# A DataLoader worker that died (the kernel's OOM killer picks it: it is the biggest process).
_DATALOADER = re.compile(r"DataLoader worker \(pid(?:\(s\))? [^)]*\) (?:exited unexpectedly|is killed by signal)")
# A traceback's frames (``File "x.py", line 3, in evaluate``): which phase the failure happened in, and
# whose code raised (decide/classify.py). Dynamo's ``from user code:`` frames after its error follow
# the traceback's own, innermost last, as the code it was tracing when it failed.
_FRAME = re.compile(r'^\s*File "([^"]*)", line (\d+), in (\S+)')
_TRACEBACK = "Traceback (most recent call last)"
# The line that ends a traceback: ``SomeError: message`` (or the bare name), flush left, after the
# frames (indented), optionally behind torchrun's ``[rank0]:`` prefix.
_EXCEPTION = re.compile(r"^(?:\[[^\]]*\]:?\s*)?([A-Za-z_][\w.]*(?::\s.*|:)?)$")
_RANK_PREFIX = re.compile(r"^\[[^\]]*\]:?\s?")
# The worker (or a library under it) ran out of disk: a checkpoint or a log write failed.
_DISK_FULL = re.compile(r"(No space left on device|\bENOSPC\b|\[Errno 28\]|Disk quota exceeded|\bEDQUOT\b)")
# The last line of an exception no restart can fix (at the start of a line, or after torchrun's
# ``[rank0]:`` prefix): the import failed, the source does not compile, a file the script opens is missing.
_FATAL = re.compile(r"^(?:\[[^\]]*\]:?\s*)?((?:ModuleNotFoundError|ImportError|SyntaxError|IndentationError|TabError"
                    r"|FileNotFoundError)\b.*)$")
_USAGE = re.compile(r"^(?:\[[^\]]*\]:?\s*)?usage: ")
_USAGE_ERROR = re.compile(r"^(?:\[[^\]]*\]:?\s*)?(\S+: error: .*)$")  # argparse's line after its usage
_TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) ([KMGT]?i?B)")
# What the process may use: a per-process memory fraction ("23.75 GiB allowed") or the whole device.
_ALLOWED = re.compile(r"(\d+(?:\.\d+)?) ([KMGT]?i?B) allowed")
_CAPACITY = re.compile(r"total capacity of (\d+(?:\.\d+)?) ([KMGT]?i?B)")
_RESERVED = re.compile(r"(\d+(?:\.\d+)?) ([KMGT]?i?B) is reserved by PyTorch but unallocated")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6,
          "GB": 10**9}


class Site(NamedTuple):
    """One frame of a traceback as Python prints it."""

    file: str
    line: int
    function: str


def device_oom_line(line: str) -> str | None:
    """``line`` stripped when it reports a device allocation failure, else None."""
    return line.strip() if _DEVICE_OOM.search(line) else None


def host_oom_line(line: str) -> str | None:
    """``line`` stripped when it reports a host allocation failure, else None."""
    return line.strip() if _HOST_OOM.search(line) else None


# Substrings every evidence line above contains one of (case as written): a line with none of them
# skips the regexes (a dozen C-speed substring tests instead of a dozen regex searches per line).
MARKERS = ("rror", "usage: ", "emory", "ALLOC", "EOF", "Ran out of input", "heckpoint", "pace left", "ENOSPC",
           "Errno 28", "quota", "EDQUOT", "BadZip", "HeaderTooLarge", "DataLoader", "Traceback", 'File "', "allowed",
           "capacity")


# The evidence lines ``OutputScanner`` keeps, by field.
_EVIDENCE = (("disk_full", _DISK_FULL), ("device_oom", _DEVICE_OOM), ("host_oom", _HOST_OOM),
             ("load_error", _LOAD_ERROR), ("dataloader", _DATALOADER))


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS.get(unit, 1))


@dataclass
class OutputScanner:
    """Keeps the first line of each kind of evidence seen in the worker's output, as it streams."""

    device_oom: str | None = None
    host_oom: str | None = None
    load_error: str | None = None
    tried_bytes: int | None = None
    reserved_unallocated: int | None = None
    capacity_bytes: int | None = None  # what the process may use, from the same OOM message
    allowed_bytes: int | None = None  # the same, when the message names a per-process cap ("23.75 GiB allowed")
    disk_full: str | None = None
    tail: list[str] = field(default_factory=list)
    lines: int = 0
    dataloader: str | None = None  # a DataLoader worker died
    frames: list[str] = field(default_factory=list)  # function names of the newest traceback, outermost first
    sites: list[Site] = field(default_factory=list)  # its (file, line, function), the innermost 200 at least
    framed_at: int = 0  # the output line of the newest traceback's last frame
    fatal: str | None = None  # the newest exception line of a kind no restart can fix (``_FATAL``)
    fatal_untraced: bool = False  # ... with no traceback before it: python could not compile the script itself
    usage_error: str | None = None  # argparse's ``prog: error: ...`` after its ``usage:`` line
    # The exception line that ended the newest traceback (``AssertionError: ...``): a crash's evidence,
    # not the hints a library prints after it (dynamo's ``Set TORCHDYNAMO_VERBOSE=1 ...``).
    exception: str | None = None
    _in_traceback: bool = False  # between a traceback's header and its exception line
    _traced: bool = False  # a traceback was seen
    _usage: bool = False  # a ``usage:`` line was seen

    def feed(self, line: str) -> None:
        self.lines += 1
        self.tail.append(line)
        if len(self.tail) > 40:  # trimmed now and then, not on every line
            del self.tail[:-20]
        if self._in_traceback:  # before the markers: an exception's name may contain none of them
            self._traced_line(line)
        elif _TRACEBACK in line and _RANK_PREFIX.sub("", line, count=1).startswith(_TRACEBACK):
            self._in_traceback = True
        for marker in MARKERS:
            if marker in line:
                break
        else:
            return
        for name, pattern in _EVIDENCE:
            setattr(self, name, _keep(getattr(self, name), line, pattern))
        self._fatal(line)
        if line.startswith(_TRACEBACK):
            self.frames, self.sites = [], []
            self._traced = True
        elif m := _FRAME.match(line):
            if len(self.frames) < 200:
                self.frames.append(m.group(3))
            self.sites.append(Site(m.group(1), int(m.group(2)), m.group(3)))
            if len(self.sites) > 400:  # the innermost frames are the ones that tell whose code raised
                del self.sites[:-200]
            self.framed_at = self.lines
        if (m := _TRIED.search(line)) and self.tried_bytes is None:
            self.tried_bytes = _bytes(*m.groups())
        if (m := _RESERVED.search(line)) and self.reserved_unallocated is None:
            self.reserved_unallocated = _bytes(*m.groups())
        if self.capacity_bytes is None and (m := _ALLOWED.search(line) or _CAPACITY.search(line)):
            self.capacity_bytes = _bytes(*m.groups())
            if m.re is _ALLOWED:
                self.allowed_bytes = self.capacity_bytes

    def _traced_line(self, line: str) -> None:
        """A line after a traceback's header: its frames and source are indented; the first line
        flush left ends it, the exception line when it reads as one (``Name: message``)."""
        text = _RANK_PREFIX.sub("", line, count=1).rstrip("\n")
        if not text.strip() or text[:1].isspace() or text.startswith(_TRACEBACK):
            return
        self._in_traceback = False
        if (m := _EXCEPTION.match(text.strip())) is not None:
            self.exception = m.group(1).strip()[:500]

    def _fatal(self, line: str) -> None:
        if (m := _FATAL.match(line)) is not None:
            self.fatal, self.fatal_untraced = m.group(1).strip(), not self._traced
        elif _USAGE.match(line):
            self._usage = True
        elif self._usage and self.usage_error is None and (m := _USAGE_ERROR.match(line)) is not None:
            self.usage_error = m.group(1).strip()

    @property
    def fragmented(self) -> bool:
        """More memory reserved-but-unallocated than the failed request: a fragmentation OOM."""
        return (self.device_oom is not None and self.tried_bytes is not None
                and self.reserved_unallocated is not None and self.reserved_unallocated > self.tried_bytes)


def _keep(current: str | None, line: str, pattern: re.Pattern[str]) -> str | None:
    """The evidence line to keep: the first match, but an exception message beats the indented
    source line a traceback quotes before it (``raise torch.OutOfMemoryError(...)``)."""
    if not pattern.search(line):
        return current
    quoted = line[:1].isspace()
    if current is None or (current.startswith(" ") and not quoted):
        return (" " + line.strip()) if quoted else line.strip()
    return current


# Which phase of training an attempt was in when it failed: evaluation, saving or loading a checkpoint.
#
# Read from what the output scanner kept: the function names of the newest traceback (innermost
# first, so ``train -> evaluate -> forward`` is evaluation, and ``evaluate -> torch.save`` is saving), or,
# when the worker died without one (SIGKILL from the OOM killer), its last lines of output such as
# ``Evaluating...`` or ``Saving checkpoint to ...``. Pure: the tests feed it lines.


class Phase(enum.Enum):
    EVALUATION = "evaluation"
    SAVING = "checkpoint saving"
    LOADING = "checkpoint loading"


# Function names, matched on their ``_``-separated words: ``evaluate``, ``eval_loop``,
# ``evaluation_loop``, ``validation_step``, ``_validate``; ``save``, ``torch.save``'s ``save``,
# ``save_checkpoint``, ``save_pretrained``, ``_save``; ``load``, ``load_state_dict``,
# ``_load_from_state_dict``, ``load_checkpoint``, ``from_pretrained``. ``dataloader`` or
# ``_next_data`` are none of them.
_FUNCTION = {
    Phase.EVALUATION: re.compile(r"(?:^|_)(?:eval|evaluate|evaluation|evaluator|validate|validation|val)(?:_|$)"),
    Phase.SAVING: re.compile(r"(?:^|_)(?:save|saving|checkpointing)(?:_|$)|^_?write_checkpoint"),
    Phase.LOADING: re.compile(r"(?:^|_)(?:load|loading|restore|resume)(?:_|$)|^from_pretrained$"),
}
# Lines a script prints as it enters a phase (only the last few lines are read).
_LINE = {
    Phase.EVALUATION: re.compile(r"^\W*(?:running |starting )?(?:evaluat|validat)\w*", re.IGNORECASE),
    Phase.SAVING: re.compile(r"\bsaving (?:the )?(?:model|checkpoint|state)", re.IGNORECASE),
    Phase.LOADING: re.compile(r"\b(?:loading|resuming from) (?:the )?(?:model|checkpoint|state)", re.IGNORECASE),
}
LAST_LINES = 3


def phase_of(frames: Sequence[str], tail: Sequence[str]) -> tuple[Phase, str] | None:
    """(phase, the evidence that named it), or None when nothing names a phase."""
    for name in reversed(frames):  # innermost first: the phase the failing call was made in
        for phase, pattern in _FUNCTION.items():
            if pattern.search(name):
                return phase, f"traceback through {name}()"
    if frames:
        return None  # a traceback that names no phase: training itself
    last = [line.strip() for line in tail if line.strip()][-LAST_LINES:]
    for line in reversed(last):
        for phase, pattern in _LINE.items():
            if pattern.search(line):
                return phase, f"last output: {line[:120]}"
    return None
