"""What ended an attempt: a ``FailureKind`` and the evidence that decided it.

``classify`` turns the exit status, the evidence ``observe.output.OutputScanner`` kept from the
worker's output and the OOM-kill counters into a kind. It is pure, so the tests feed it text and numbers.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

from oomguard.supervisor.observe.output import OutputScanner


class FailureKind(enum.Enum):
    CUDA_OOM = "cuda_oom"
    HOST_OOM = "host_oom"
    MEMORY_LIMIT = "memory_limit"
    HANG = "hang"
    KILLED = "killed"
    CRASH = "crash"
    DISK_FULL = "disk_full"  # the worker died of ENOSPC (a checkpoint or log it could not write)

    @property
    def is_memory(self) -> bool:
        return self in (FailureKind.CUDA_OOM, FailureKind.HOST_OOM, FailureKind.MEMORY_LIMIT)


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
    if scan.dataloader and _counter_rose(facts):  # the main process lives on to report its worker's death
        counter = f"{facts.oom_counter} oom_kill {facts.oom_kills_before}->{facts.oom_kills_after}"
        return verdict(FailureKind.MEMORY_LIMIT if facts.limit_hit else FailureKind.HOST_OOM,
                       f"{scan.dataloader.strip()} (killed by the kernel OOM killer: {counter})")
    if facts.worker_failure and (kind := _worker_kind(facts.worker_failure)):
        return verdict(kind, str(facts.worker_failure.get("message", "")))
    if scan.device_oom:
        return verdict(FailureKind.CUDA_OOM, scan.device_oom.strip())
    if scan.host_oom:
        return verdict(FailureKind.HOST_OOM, scan.host_oom.strip())
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        return verdict(FailureKind.KILLED, f"terminated by {name}; no OOM-kill counter moved")
    if scan.disk_full:  # it exited on its own, having said it could not write
        return verdict(FailureKind.DISK_FULL, scan.disk_full.strip())
    last = next((line.strip() for line in reversed(scan.tail[-20:]) if line.strip()), "")
    return verdict(FailureKind.CRASH, f"exit code {code}" + (f": {last}" if last else ""))


def _counter_rose(facts: ExitFacts) -> bool:
    before, after = facts.oom_kills_before, facts.oom_kills_after
    return before is not None and after is not None and after > before
