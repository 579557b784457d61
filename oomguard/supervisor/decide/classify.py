"""What ended an attempt: a ``FailureKind`` and the evidence that decided it.

``classify`` turns the exit status, the evidence ``observe.output.OutputScanner`` kept from the
worker's output, the OOM-kill counters and, under torchrun, the root-cause rank into a kind. It is
pure, so the tests feed it text and numbers.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

from oomguard.supervisor.distributed.errorfiles import RootCause
from oomguard.supervisor.observe.output import OutputScanner


class FailureKind(enum.Enum):
    CUDA_OOM = "cuda_oom"  # the accelerator's memory, whichever: CUDA, ROCm/HIP, MPS, XPU (docs/oom-messages.md)
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


_OOM_KINDS = {"cuda_oom": FailureKind.CUDA_OOM, "host_oom": FailureKind.HOST_OOM}


def classify(facts: ExitFacts, scan: OutputScanner, cause: RootCause | None = None, gpus: bool = False) -> Verdict:
    """Decide the kind of an attempt's end; the first rule that matches wins, most specific first.

    Under torchrun the supervised process is the agent, which exits 1 whatever killed a rank, so
    with a root-cause rank (``dist.errorfiles.root_cause``) the rules read that rank's exit and the
    evidence names it; collective timeouts on the surviving ranks are consequences and never decide.
    """
    if facts.returncode == 0:
        return Verdict(None, "exit code 0", None, 0)
    code, sig = _split_status(facts.returncode)
    where = ""
    if cause is not None and not (facts.hung or facts.stopped_for_memory):  # oomguard's own stops name no rank
        code = cause.exitcode if cause.exitcode is not None and cause.exitcode >= 0 else None
        sig, where = cause.signal, f"{cause.where(gpus)}: "

    def verdict(kind: FailureKind, evidence: str) -> Verdict:
        return Verdict(kind, where + evidence, sig, code)

    if facts.hung:
        return verdict(FailureKind.HANG, facts.hung)
    if facts.stopped_for_memory:
        return verdict(FailureKind.MEMORY_LIMIT, facts.stopped_for_memory)
    if sig == signal.SIGKILL and _counter_rose(facts):
        counter = f"{facts.oom_counter} oom_kill {facts.oom_kills_before}->{facts.oom_kills_after}"
        if facts.limit_hit:
            return verdict(FailureKind.MEMORY_LIMIT, f"{counter} at oomguard's --memory-limit")
        return verdict(FailureKind.HOST_OOM, f"killed by the kernel OOM killer ({counter})")
    if cause is None and scan.dataloader and _counter_rose(facts):  # the main process lives on to report it
        counter = f"{facts.oom_counter} oom_kill {facts.oom_kills_before}->{facts.oom_kills_after}"
        return verdict(FailureKind.MEMORY_LIMIT if facts.limit_hit else FailureKind.HOST_OOM,
                       f"{scan.dataloader.strip()} (killed by the kernel OOM killer: {counter})")
    # A structured report (the rank's error file, the worker library's record) before parsed text.
    if (reported := _reported(cause, facts.worker_failure)) is not None:
        return verdict(*reported)
    if scan.device_oom:
        return verdict(FailureKind.CUDA_OOM, scan.device_oom.strip())
    if scan.host_oom:
        return verdict(FailureKind.HOST_OOM, scan.host_oom.strip())
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        return verdict(FailureKind.KILLED, f"terminated by {name}; no OOM-kill counter moved")
    if scan.disk_full:  # it exited on its own, having said it could not write
        return verdict(FailureKind.DISK_FULL, scan.disk_full.strip())
    if cause is not None:
        return verdict(FailureKind.CRASH, f"exit code {cause.exitcode}: {cause.message}"
                       if cause.exitcode is not None else cause.message)
    # The exception that ended the traceback, not the hints a library prints after it; else the last line.
    last = scan.exception or next((line.strip() for line in reversed(scan.tail[-20:]) if line.strip()), "")
    return verdict(FailureKind.CRASH, f"exit code {code}" + (f": {last}" if last else ""))


def _reported(cause: RootCause | None, record: dict[str, object] | None) -> tuple[FailureKind, str] | None:
    """An allocation failure the failing process reported itself: its rank's error, else its record."""
    if cause is not None and cause.oom_kind in _OOM_KINDS:
        return _OOM_KINDS[cause.oom_kind], cause.message
    if record and (kind := _OOM_KINDS.get(str(record.get("kind", "")))):
        return kind, str(record.get("message", ""))
    return None


def _counter_rose(facts: ExitFacts) -> bool:
    before, after = facts.oom_kills_before, facts.oom_kills_after
    return before is not None and after is not None and after > before
