"""The ranks' launcher: which one starts them (torchrun, ``accelerate launch`` or none), each
attempt's argv, and which rank failed first, read back from torchrun's per-rank error files.

Tested in tests/unit/supervisor/distributed/test_torchrun.py, tests/unit/supervisor/test_command.py,
tests/e2e/test_torchrun.py and tests/e2e/test_accelerate.py.

oomguard's own options (``--nproc-per-node`` ...) wrap a plain command in torchrun; given beside a
launcher's command they must agree with it. A rank's error is read from the ``error.json`` that
``@record`` writes under ``--log-dir``, else from its ``[rankN]:`` lines and torchrun's ``Root Cause``
block. torchrun's own root cause is the earliest timestamp, which names the wrong rank when the
first to fail left no file; here it is chosen by evidence: an OOM beats any other failure, and a
rank torchrun stopped (SIGTERM) or that timed out in a collective is a consequence.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeAlias

from oomguard.supervisor.distributed import accelerate, torchrun
from oomguard.supervisor.distributed.accelerate import AccelerateLaunch
from oomguard.supervisor.distributed.torchrun import Shape, Torchrun
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.observe.output import device_oom_line, host_oom_line

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

_PREFIX = re.compile(r"^\[(?:default)?rank(\d+)\]:\s?(.*)$")
_ENTRY = re.compile(r"^\s*\[(\d+)\]:\s*$")
_FIELD = re.compile(r"^\s{2}(host|rank|exitcode|traceback)\s*:\s?(.*)$")
_RANK = re.compile(r"(\d+) \(local_rank: (\d+)\)")
_EXIT = re.compile(r"(-?\d+) \(pid: \d+\)")
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
    host: str = ""
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
        if (m := _PREFIX.match(line)) is None:
            self._block_line(line)
            return
        rank, text = int(m.group(1)), m.group(2)
        if text.strip():
            self.last[rank] = text.strip()
        if rank not in self.oom and (hit := _oom(text)) is not None:
            self.oom[rank] = hit

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
            entry.exitcode = int(m.group(1))
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
            message = str(message.get("message", ""))
        if isinstance(message, str):
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
        return {k: v for k, v in asdict(self).items() if k != "torchrun_root"}


def root_cause(scan: RankScanner, error_files: dict[int, dict[str, object]]) -> RootCause | None:
    """The rank to blame, chosen by evidence (see the module docstring); None when no rank failed."""
    ranks = sorted(set(scan.failures) | set(scan.oom))
    return min((_evidence(rank, scan, error_files) for rank in ranks), key=_blame_order, default=None)


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
    own = oom or _oom(message)
    if oom and source != "error file":
        message = oom[1]
    return RootCause(rank, local, failure.exitcode, failure.signal, failure.host, message, own[0] if own else None,
                     source, failure.root_by_torchrun)


def _oom(text: str) -> tuple[str, str] | None:
    """("cuda_oom" or "host_oom", the line) where ``text`` tells an allocation failure."""
    if (hit := device_oom_line(text)) is not None:
        return "cuda_oom", hit
    hit = host_oom_line(text)
    return None if hit is None else ("host_oom", hit)


def _blame_order(cause: RootCause) -> tuple[int, int, int]:
    """Lower is more to blame: an OOM, a SIGKILL from outside, a crash of its own, a collective timeout,
    and a rank torchrun stopped (SIGTERM) last; within a tier torchrun's own root cause, then the lowest rank."""
    tier = (0 if cause.oom_kind is not None else 1 if cause.signal == 9 else 4 if cause.signal == 15
            else 3 if _CONSEQUENCE.search(cause.message) else 2)
    return tier, 0 if cause.torchrun_root else 1, cause.rank


# Which launcher starts the ranks, and one attempt's argv.

Launch: TypeAlias = Torchrun | AccelerateLaunch


def parse(command: Sequence[str]) -> Launch | None:
    """The launcher line COMMAND starts with, or None for a plain command."""
    return torchrun.parse(command) or accelerate.parse(command)


def shape_of(command: Sequence[str], nproc_per_node: int | None, nnodes: int | None, node_rank: int | None,
             rdzv_endpoint: str | None) -> tuple[Shape | None, Launch | None]:
    """The world's shape (None: one process) and the launcher line each attempt is built from."""
    launch = accelerate.parse(command)
    if launch is None:
        return torchrun.shape_of(command, nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    shape = launch.shape or Shape()
    mine = {"--nproc-per-node": (nproc_per_node, shape.nproc_per_node, "--num_processes / --num_machines"),
            "--nnodes": (nnodes, shape.nnodes, "--num_machines"),
            "--node-rank": (node_rank, shape.node_rank, "--machine_rank"),
            "--rdzv-endpoint": (rdzv_endpoint, shape.rdzv_endpoint, "--main_process_ip:port")}
    for option, (value, theirs, source) in mine.items():
        if value is not None and value != theirs:
            raise UsageError(option, f"{value} disagrees with accelerate launch's {theirs} ({source})",
                             "give it once, in the accelerate launch command (or its config file)")
    return launch.shape, launch


def attempt_argv(shape: Shape, rendered: Sequence[str], log_dir: Path, rdzv_id: str | None,
                 nnodes: int | None = None) -> list[str]:
    """One attempt's argv from the rendered COMMAND: its own launcher line, or torchrun around a plain
    command. ``nnodes``: this round's nodes of an elastic run (only torchrun's ``--nnodes MIN:MAX``)."""
    launch = parse(rendered) or torchrun.wrap(rendered, shape)
    if isinstance(launch, Torchrun):
        return torchrun.attempt_argv(launch, log_dir, rdzv_id, nnodes)
    return launch.attempt_argv(log_dir)


def program(command: Sequence[str]) -> tuple[str, ...] | None:
    """The Python program the command runs, as ``python`` is given it (``("train.py", args...)`` or
    ``("-m", "pkg", args...)``), behind any launcher; None when it runs no Python file of its own."""
    if (launch := parse(command)) is not None:
        return launch.program or None
    return tuple(command[1:]) if len(command) >= 2 and Path(command[0]).name.startswith("python") else None


@dataclass
class TorchrunAttempt:
    argv: list[str]
    log_dir: Path  # torchrun's --log-dir for this attempt: <log_dir>/<run>/attempt_0/<local_rank>/error.json
    scanner: RankScanner = field(default_factory=RankScanner)

    @classmethod
    def of(cls, shape: Shape | None, rendered: Sequence[str], log_dir: Path,
           rdzv_id: str | None = None, nnodes: int | None = None) -> TorchrunAttempt | None:
        """The attempt of a run with ranks (``shape`` set; see ``attempt_argv``); None for one process."""
        if shape is None:
            return None
        log_dir.mkdir(parents=True, exist_ok=True)
        return cls(attempt_argv(shape, rendered, log_dir, rdzv_id if shape.nnodes > 1 else None, nnodes), log_dir)

    @property
    def agent_error_file(self) -> Path:
        """torchrun's own error file: its ``@record`` copies the root-cause rank's error there."""
        return self.log_dir / "agent-error.json"

    def root_cause(self) -> RootCause | None:
        return root_cause(self.scanner, read_error_files(self.log_dir))
