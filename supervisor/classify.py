"""What ended an attempt: a ``FailureKind`` and the evidence that decided it.

Two parts: ``OutputScanner`` reads the worker's output line by line as it streams and keeps the
lines that matter; ``classify`` turns the exit status, those lines and the OOM-kill counters into
a kind. Both are pure apart from the scanner's own state, so the tests feed them text and numbers.
"""

from __future__ import annotations

import enum
import re
import signal
from dataclasses import dataclass, field

# The texts by which PyTorch, CUDA, cuBLAS, cuDNN and HIP report an allocation failure on the device.
_DEVICE_OOM = re.compile(
    r"(torch\.(?:cuda\.)?OutOfMemoryError|CUDA out of memory|CUDA error: out of memory"
    r"|CUDA driver error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED"
    r"|cuDNN error: CUDNN_STATUS_NOT_ALLOC|HIP out of memory|hipErrorOutOfMemory"
    r"|HIP error: out of memory|MPS backend out of memory)"
)
# PyTorch's host allocator failure (seen under RLIMIT_AS or a full machine) and Python's own.
_HOST_OOM = re.compile(r"(DefaultCPUAllocator: can't allocate memory|^MemoryError\b|\bMemoryError: )")
# A worker that cannot read its checkpoint dies with one of these before making progress.
_LOAD_ERROR = re.compile(
    r"(PytorchStreamReader failed|failed finding central directory|Error\(s\) in loading state_dict"
    r"|UnpicklingError|invalid load key|Ran out of input|BadZipFile|unexpected EOF|EOFError"
    r"|SafetensorError|HeaderTooLarge|checkpoint is (?:corrupt|incomplete|invalid))",
    re.IGNORECASE,
)
_TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) ([KMGT]?i?B)")
_RESERVED = re.compile(r"(\d+(?:\.\d+)?) ([KMGT]?i?B) is reserved by PyTorch but unallocated")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6,
          "GB": 10**9}


class FailureKind(enum.Enum):
    CUDA_OOM = "cuda_oom"
    HOST_OOM = "host_oom"
    MEMORY_LIMIT = "memory_limit"
    HANG = "hang"
    KILLED = "killed"
    CRASH = "crash"

    @property
    def is_memory(self) -> bool:
        return self in (FailureKind.CUDA_OOM, FailureKind.HOST_OOM, FailureKind.MEMORY_LIMIT)


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
    tail: list[str] = field(default_factory=list)
    lines: int = 0

    def feed(self, line: str) -> None:
        self.lines += 1
        self.tail = (self.tail + [line])[-20:]
        self.device_oom = _keep(self.device_oom, line, _DEVICE_OOM)
        self.host_oom = _keep(self.host_oom, line, _HOST_OOM)
        self.load_error = _keep(self.load_error, line, _LOAD_ERROR)
        if (m := _TRIED.search(line)) and self.tried_bytes is None:
            self.tried_bytes = _bytes(*m.groups())
        if (m := _RESERVED.search(line)) and self.reserved_unallocated is None:
            self.reserved_unallocated = _bytes(*m.groups())

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


@dataclass(frozen=True)
class ExitFacts:
    """What the supervisor knows when an attempt ends."""

    returncode: int
    oom_kills_before: int | None = None  # the worker cgroup's (or /proc/vmstat's) oom_kill counter
    oom_kills_after: int | None = None
    oom_counter: str = ""  # where the counter came from, for the evidence
    limit_hit: bool = False  # the worker's own cgroup reached oomguard's --memory-limit
    stopped_for_memory: str | None = None  # oomguard stopped it: the reading that broke the budget
    hung: str | None = None  # oomguard killed it as hung: why
    worker_failure: dict[str, object] | None = None  # a structured failure record from the worker


@dataclass(frozen=True)
class Verdict:
    kind: FailureKind | None  # None: the worker succeeded
    evidence: str
    signal: int | None
    exit_code: int | None


def _split_status(returncode: int) -> tuple[int | None, int | None]:
    """(exit code, signal): Popen gives -N for death by signal N; a shell reports 128+N."""
    if returncode < 0:
        return None, -returncode
    if 128 < returncode <= 128 + 64:
        return returncode, returncode - 128
    return returncode, None


def _worker_kind(record: dict[str, object]) -> FailureKind | None:
    kind = str(record.get("kind", ""))
    return {"cuda_oom": FailureKind.CUDA_OOM, "host_oom": FailureKind.HOST_OOM}.get(kind)


def classify(facts: ExitFacts, scan: OutputScanner) -> Verdict:
    """Decide the kind of an attempt's end; the first rule that matches wins, most specific first."""
    code, sig = _split_status(facts.returncode)
    if facts.returncode == 0:
        return Verdict(None, "exit code 0", None, 0)

    def verdict(kind: FailureKind, evidence: str) -> Verdict:
        return Verdict(kind, evidence, sig, code)

    if facts.hung:
        return verdict(FailureKind.HANG, facts.hung)
    if facts.stopped_for_memory:
        return verdict(FailureKind.MEMORY_LIMIT, facts.stopped_for_memory)
    if sig == signal.SIGKILL and _counter_rose(facts):
        counter = f"{facts.oom_counter} oom_kill {facts.oom_kills_before}->{facts.oom_kills_after}"
        if facts.limit_hit:
            return verdict(FailureKind.MEMORY_LIMIT, f"{counter} at oomguard's --memory-limit")
        return verdict(FailureKind.HOST_OOM, f"killed by the kernel OOM killer ({counter})")
    if facts.worker_failure and (kind := _worker_kind(facts.worker_failure)):
        return verdict(kind, str(facts.worker_failure.get("message", "")))
    if scan.device_oom:
        return verdict(FailureKind.CUDA_OOM, scan.device_oom.strip())
    if scan.host_oom:
        return verdict(FailureKind.HOST_OOM, scan.host_oom.strip())
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        return verdict(FailureKind.KILLED, f"terminated by {name}; no OOM-kill counter moved")
    last = next((line.strip() for line in reversed(scan.tail) if line.strip()), "")
    return verdict(FailureKind.CRASH, f"exit code {code}" + (f": {last}" if last else ""))


def _counter_rose(facts: ExitFacts) -> bool:
    before, after = facts.oom_kills_before, facts.oom_kills_after
    return before is not None and after is not None and after > before
