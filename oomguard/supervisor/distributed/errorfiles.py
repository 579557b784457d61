"""Which rank failed first, and how: torchrun's per-rank error files, read back after an attempt.

Tested in tests/unit/supervisor/distributed/test_torchrun.py.

torchrun gives every rank ``TORCHELASTIC_ERROR_FILE=<log-dir>/<run>/attempt_<k>/<local_rank>/error.json``;
a script whose entry point is wrapped in ``torch.distributed.elastic.multiprocessing.errors.record``
writes its exception there as JSON (message, traceback, timestamp). oomguard passes ``--log-dir`` so
these files land in the run directory, reads them, and falls back to text for scripts without
``@record``: the ``[rankN]:`` prefix torch.distributed puts on an uncaught exception's traceback,
and the ``Failures`` / ``Root Cause`` block torchrun prints when it gives up.

torchrun's own "root cause" is the failure with the earliest timestamp, and a rank without an error
file is stamped with the time the agent noticed it, so it names the wrong rank when the first
rank to fail left no file. Here the root cause is chosen by evidence: a rank with an OOM beats any
other, a rank that torchrun itself stopped (SIGTERM after another rank failed) or that only timed
out in a collective (NCCL/Gloo, "connection closed by peer") is a consequence, not a cause.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from oomguard.supervisor.observe.output import device_oom_line, host_oom_line

_PREFIX = re.compile(r"^\[(?:default)?rank(\d+)\]:\s?(.*)$")
_ENTRY = re.compile(r"^\s*\[(\d+)\]:\s*$")
_FIELD = re.compile(r"^\s{2}(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")
_RANK = re.compile(r"(\d+) \(local_rank: (\d+)\)")
_EXIT = re.compile(r"(-?\d+) \(pid: (\d+)\)")
# What a rank prints when a peer died under it: a consequence, never a root cause.
_CONSEQUENCE = re.compile(
    r"(Connection closed by peer|Connection reset by peer|timed out|Timeout|Watchdog caught collective operation"
    r"|NCCL communicator was aborted|ProcessGroupNCCL.*(?:abort|timeout)|Gloo connectFullMesh failed"
    r"|Socket Timeout|DistBackendError|DistNetworkError|Broken pipe)", re.IGNORECASE)


@dataclass
class RankFailure:
    """One failed rank, as torchrun reported it (or as its output showed it)."""

    rank: int
    local_rank: int | None = None
    exitcode: int | None = None  # torchrun's: -N for death by signal N
    pid: int | None = None
    host: str = ""
    error_file: str | None = None
    message: str = ""  # from the error file, else torchrun's traceback line
    root_by_torchrun: bool = False

    @property
    def signal(self) -> int | None:
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None


@dataclass
class RankScanner:
    """Fed the attempt's output line by line; keeps each rank's evidence and torchrun's failure block."""

    oom: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (kind, first OOM line)
    last: dict[int, str] = field(default_factory=dict)  # rank -> last non-empty line (its exception)
    failures: dict[int, RankFailure] = field(default_factory=dict)  # by global rank
    _in_root: bool = False
    _entry: RankFailure | None = None

    def feed(self, line: str) -> None:
        if (m := _PREFIX.match(line)) is not None:
            rank, text = int(m.group(1)), m.group(2)
            self._rank_line(rank, text)
            return
        self._block_line(line)

    def _rank_line(self, rank: int, text: str) -> None:
        if text.strip():
            self.last[rank] = text.strip()
        if rank not in self.oom:
            if (hit := device_oom_line(text)) is not None:
                self.oom[rank] = ("cuda_oom", hit)
            elif (hit := host_oom_line(text)) is not None:
                self.oom[rank] = ("host_oom", hit)

    def _block_line(self, line: str) -> None:
        if line.startswith("Root Cause (first observed failure)"):
            self._in_root = True
        elif line.startswith("Failures:"):
            self._in_root = False
        elif _ENTRY.match(line):
            self._entry = RankFailure(-1, root_by_torchrun=self._in_root)
        elif self._entry is not None and (m := _FIELD.match(line)):
            self._field(self._entry, m.group(1), m.group(2).strip())

    def _field(self, entry: RankFailure, name: str, value: str) -> None:
        if name == "host":
            entry.host = value
        elif name == "rank" and (m := _RANK.match(value)):
            entry.rank, entry.local_rank = int(m.group(1)), int(m.group(2))
            self.failures[entry.rank] = entry
        elif name == "exitcode" and (m := _EXIT.match(value)):
            entry.exitcode, entry.pid = int(m.group(1)), int(m.group(2))
        elif name == "error_file" and value != "<N/A>":
            entry.error_file = value
        elif name == "traceback":
            entry.message = value
            self._entry = None  # the traceback is the entry's last field


def read_error_files(log_dir: Path) -> dict[int, dict[str, object]]:
    """Every rank's error.json under torchrun's ``--log-dir`` of one attempt, by local rank."""
    found: dict[int, dict[str, object]] = {}
    for path in sorted(log_dir.glob("*/attempt_*/*/error.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # written by a dying process: half a file is no evidence
        message = data.get("message") if isinstance(data, dict) else None
        if isinstance(message, dict):
            found[int(path.parent.name)] = {"message": str(message.get("message", "")), "path": str(path)}
        elif isinstance(message, str):
            found[int(path.parent.name)] = {"message": message, "path": str(path)}
    return found


@dataclass(frozen=True)
class RootCause:
    """The rank whose failure ended the attempt, and the evidence that names it."""

    rank: int
    local_rank: int | None
    exitcode: int | None
    signal: int | None
    host: str
    message: str  # the rank's own error: error file, OOM line or last line of its traceback
    oom_kind: str | None  # "cuda_oom" / "host_oom" when the rank's own error was an allocation failure
    source: str  # "error file", "rank output" or "torchrun"
    torchrun_root: bool = False  # torchrun named it "Root Cause" too

    def where(self, gpus: bool) -> str:
        """``rank 1 (local rank 1, GPU 1)``: GPU i is local rank i's device under torchrun."""
        local = f"local rank {self.local_rank}" if self.local_rank is not None else "local rank ?"
        gpu = f", GPU {self.local_rank}" if gpus and self.local_rank is not None else ""
        host = f" on {self.host}" if self.host else ""
        return f"rank {self.rank} ({local}{gpu}){host}"

    def as_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "local_rank": self.local_rank, "exitcode": self.exitcode, "signal": self.signal,
                "host": self.host, "message": self.message, "oom_kind": self.oom_kind, "source": self.source}


def root_cause(scan: RankScanner, error_files: dict[int, dict[str, object]]) -> RootCause | None:
    """The rank to blame, chosen by evidence (see the module docstring); None when no rank failed."""
    ranks = set(scan.failures) | set(scan.oom)
    if not ranks:
        return None
    candidates = [_evidence(rank, scan, error_files) for rank in sorted(ranks)]
    return min(candidates, key=_blame_order)


def _evidence(rank: int, scan: RankScanner, error_files: dict[int, dict[str, object]]) -> RootCause:
    failure = scan.failures.get(rank, RankFailure(rank))
    local = failure.local_rank
    from_file = error_files.get(local) if local is not None else None
    message, source = failure.message, "torchrun"
    if rank in scan.last:
        message, source = scan.last[rank], "rank output"
    if from_file and from_file.get("message"):
        message, source = str(from_file["message"]), "error file"
    oom = scan.oom.get(rank)
    oom_kind = oom[0] if oom else _oom_kind(message)
    if oom and source != "error file":
        message = oom[1]
    return RootCause(rank, local, failure.exitcode, failure.signal, failure.host, message, oom_kind, source,
                     failure.root_by_torchrun)


def _oom_kind(text: str) -> str | None:
    if device_oom_line(text) is not None:
        return "cuda_oom"
    return "host_oom" if host_oom_line(text) is not None else None


def _blame_order(cause: RootCause) -> tuple[int, int, int]:
    """Lower is more to blame: an OOM, then a rank killed from outside (SIGKILL), then a crash of
    its own, then a collective timeout; a rank torchrun stopped (SIGTERM) comes last. Within a tier
    torchrun's own root cause, then the lowest rank."""
    if cause.oom_kind is not None:
        tier = 0
    elif cause.signal == 9:
        tier = 1
    elif cause.signal == 15:
        tier = 4
    elif _CONSEQUENCE.search(cause.message):
        tier = 3
    else:
        tier = 2
    return tier, 0 if cause.torchrun_root else 1, cause.rank
