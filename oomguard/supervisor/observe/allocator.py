"""What the in-process probe reports about one attempt: real optimizer steps and the allocator's figures.

Tested in tests/unit/supervisor/observe/test_progress.py (the probe's figures), tests/unit/probe/test_steps.py.

The probe (``oomguard/probe/``) runs inside every Python process of the worker and appends ``step``
and ``oom`` records to the channel (``common.protocol``). ``AllocatorReport`` folds them: the step
training reached (the same on every rank: the highest one seen), how fast steps go (timed by one
process, the lowest rank, from the seconds each record says its steps took), the CUDA caching
allocator's peaks since the attempt began (what the model allocated, not the driver's view NVML
gives, which adds the CUDA context and the allocator's cache and misses peaks shorter than a
sampling period), the limit the allocator may reach (a per-process memory fraction's cap, else the
device), and the allocator's figures at a CUDA OOM (``AllocatorOom``). Pure: the loop hands it
records.

Also here:

- Whether the probe (oomguard/probe/) is in the worker, and if not, why: for the journal and status.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from oomguard.common import protocol
from oomguard.supervisor.command.placeholders import SHELLS, unwrap


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class AllocatorOom:
    """The allocator at a CUDA OOM, as torch's OOM observer saw it (fields of the ``oom`` record)."""

    device: str
    requested: int | None
    allocated: int | None
    reserved: int | None
    free: int | None
    total: int | None
    fraction: float | None = None
    step: int | None = None
    micro_batch: int | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> AllocatorOom | None:
        """The figures of a CUDA device's OOM record; None for a host OOM (``cpu``) or a foreign one."""
        device = record.get("device")
        if not isinstance(device, str) or not device.startswith("cuda"):
            return None
        fraction = record.get("fraction")
        return cls(device, _int(record.get("requested_bytes")), _int(record.get("allocated_bytes")),
                   _int(record.get("reserved_bytes")), _int(record.get("free_bytes")),
                   _int(record.get("total_bytes")),
                   float(fraction) if isinstance(fraction, (int, float)) and 0 < fraction < 1 else None,
                   _int(record.get("step")), _int(record.get("micro_batch")))

    @property
    def limit(self) -> int | None:
        """What the process's allocator may hold: the fraction's cap where one is set, else the device."""
        if self.total is None:
            return None
        return int(self.total * self.fraction) if self.fraction is not None else self.total

    @property
    def reserved_unallocated(self) -> int | None:
        """Cached by the allocator but not allocated: the room the request did not fit into."""
        if self.reserved is None or self.allocated is None:
            return None
        return max(0, self.reserved - self.allocated)


MEASURES = ("cuda_allocated", "address_space", "rss")  # what an oom record's figures count (probe/memory.py)


def _fraction_done(value: Any) -> float | None:
    """A share of the forward in (0, 1]; anything else (0, a negative, a string, NaN) is no figure."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 < value <= 1 else None


@dataclass(frozen=True)
class OomProgress:
    """How far the step had got at an OOM, on any device, and what the process held, in one measure
    (``memory``): the figures ``sizing.tuning`` predicts a smaller size from."""

    memory: str
    micro_batch: int | None
    requested: int | None
    held: int | None  # allocated_bytes: what the process held in ``memory`` at the OOM
    limit: int | None
    fixed: int | None  # held before the step's first forward
    forward_fraction: float | None  # 1.0: the forward had returned (an OOM in the loss or the backward)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> OomProgress | None:
        memory = record.get("memory")
        if memory not in MEASURES:
            return None  # an older probe's record, or a foreign one
        limit = _int(record.get("total_bytes"))
        cuda = AllocatorOom.from_record(record)
        if cuda is not None:
            limit = cuda.limit
        return cls(memory, _int(record.get("micro_batch")), _int(record.get("requested_bytes")),
                   _int(record.get("allocated_bytes")), limit, _int(record.get("fixed_bytes")),
                   _fraction_done(record.get("forward_fraction")))


@dataclass
class AllocatorReport:
    """One attempt's ``step`` and ``oom`` records, folded (whether the probe loaded at all is
    ``observe.probestate``'s)."""

    step: int | None = None  # the optimizer step reached (resumed count included), highest over ranks
    records: int = 0  # step records taken
    lead: tuple[int, int] | None = None  # (rank, pid) of the process whose records time the steps
    steps_timed: int = 0
    seconds: float = 0.0
    allocated_peak: int | None = None  # highest over devices and records of this attempt
    allocated_now: int | None = None  # the newest step record's peak (highest device): the line the forecast fits
    reserved_peak: int | None = None
    limit_bytes: int | None = None  # the lowest limit any device reported
    # The newest CUDA OOM of the attempt: one the script caught and survived (a smaller batch in
    # process) is not the one that ended it.
    oom: AllocatorOom | None = None
    progress: OomProgress | None = None  # the newest OOM's progress through the step, any device
    # Under RLIMIT_AS (a CPU process's bound): the address space's peak and the limit, lowest over processes.
    vm_peak: int | None = None
    vm_limit: int | None = None
    # What a process held right after its first optimizer step, per measure (the line's fixed memory).
    held_after_step: dict[str, int] = field(default_factory=dict)

    def take(self, record: dict[str, Any]) -> bool:
        """Fold one probe record in; True when it is a step record with a step."""
        kind = record.get("type")
        if kind == protocol.OOM:
            self.oom = AllocatorOom.from_record(record) or self.oom
            self.progress = OomProgress.from_record(record) or self.progress
        elif kind == protocol.STEP and (step := _int(record.get("step"))) is not None:
            self.records += 1
            self.step = step if self.step is None else max(self.step, step)
            self._time(record)
            self.allocated_now = self._peaks(record.get("devices"))
            self._address_space(record)
            self._held_after_step(record.get("held_after_first_step"))
            return True
        return False

    def _held_after_step(self, held: Any) -> None:
        if isinstance(held, dict):
            for measure in MEASURES:
                if (value := _int(held.get(measure))) is not None and value > 0:
                    self.held_after_step[measure] = max(self.held_after_step.get(measure, 0), value)

    def _address_space(self, record: dict[str, Any]) -> None:
        limit, peak = _int(record.get("vm_limit_bytes")), _int(record.get("vm_peak_bytes"))
        if limit and peak:
            self.vm_limit = limit if self.vm_limit is None else min(self.vm_limit, limit)
            self.vm_peak = _higher(self.vm_peak, peak)

    def _time(self, record: dict[str, Any]) -> None:
        """Steps per second from one process: ranks step together, so adding theirs would count each
        step once per rank. The lowest rank leads; a lower one seen later takes over."""
        rank = _int(record.get("rank")) or 0
        pid = _int(record.get("pid")) or 0
        if self.lead is None or rank < self.lead[0]:
            self.lead, self.steps_timed, self.seconds = (rank, pid), 0, 0.0
        if self.lead != (rank, pid):
            return
        steps, seconds = _int(record.get("steps")), record.get("seconds")
        if steps is not None and isinstance(seconds, (int, float)) and seconds > 0:
            self.steps_timed += steps
            self.seconds += float(seconds)

    def _peaks(self, devices: Any) -> int | None:
        """Fold one record's devices in; the highest allocated peak among them."""
        if not isinstance(devices, dict):
            return None
        highest = None
        for figures in devices.values():
            if not isinstance(figures, dict):
                continue
            highest = _higher(highest, _int(figures.get("allocated_peak")))
            self.allocated_peak = _higher(self.allocated_peak, _int(figures.get("allocated_peak")))
            self.reserved_peak = _higher(self.reserved_peak, _int(figures.get("reserved_peak")))
            if (limit := _int(figures.get("limit_bytes"))) and (self.limit_bytes is None or limit < self.limit_bytes):
                self.limit_bytes = limit
        return highest

    def reading(self) -> tuple[int, int] | None:
        """(the newest step peak, the limit) for the forecast; None before both are known."""
        if self.allocated_now is None or not self.limit_bytes:
            return None
        return self.allocated_now, self.limit_bytes

    @property
    def steps_per_s(self) -> float | None:
        return self.steps_timed / self.seconds if self.seconds > 0 and self.steps_timed > 0 else None

    def figures(self) -> dict[str, Any]:
        """What status and the dashboard show beside the step."""
        rate = self.steps_per_s
        return {"steps_per_s": None if rate is None else round(rate, 3), "allocated_peak": self.allocated_peak,
                "reserved_peak": self.reserved_peak, "limit_bytes": self.limit_bytes}


def _higher(old: int | None, new: int | None) -> int | None:
    if new is None:
        return old
    return new if old is None else max(old, new)


# Whether the probe (oomguard/probe/) is in the worker, and if not, why: for the journal and status.
#
# The probe writes one ``probe`` record per process that trains (state loaded, at its first optimizer
# step), one per failure, and one per part it leaves undone there by design (state partial: under
# ``torch.compile``, docs/probe.md). ``ProbeReport`` folds them into the ``probe`` entry of the journal's
# meta: loaded in N processes, failed with the probe's own words, turned off (--no-probe), or none
# seen yet and the likely reason (a command that is not Python, or no optimizer step taken yet).


MAX_FAILURES = 8  # the first failures are the story; a thousand ranks failing alike are not news


def not_python(command: list[str] | tuple[str, ...]) -> str | None:
    """Why the command is not a Python program (the program it runs behind its wrappers, ``prlimit``,
    ``env``, ``nice``, ``taskset``, ``numactl``, ``bash -c``, is no interpreter and its file has no
    python shebang), or None when it is or cannot be told. A shell script may still start Python:
    its processes get the probe all the same."""
    argv = unwrap(command)
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if name.startswith(("python", "pypy")) or name.endswith(".py") or name in SHELLS:
        return None
    path = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
    try:
        with open(path or argv[0], "rb") as script:
            first = script.readline(256)
    except OSError:
        return None
    if first.startswith(b"#!") and b"python" in first:
        return None  # torchrun, accelerate, a console script
    return f"the command ({name}) is not Python"


@dataclass
class ProbeReport:
    """What the probe said during one attempt."""

    enabled: bool = True
    command_note: str | None = None  # not_python()'s answer for the attempt's command
    loaded: dict[int, int | None] = field(default_factory=dict)  # pid -> rank
    failures: list[dict[str, Any]] = field(default_factory=list)
    off_why: str | None = None  # why it is off, when not by --no-probe (it failed an earlier attempt)
    partial: list[dict[str, Any]] = field(default_factory=list)  # what it does not do there, by design

    @staticmethod
    def for_command(enabled: bool, argv: list[str] | tuple[str, ...], off_why: str | None = None) -> ProbeReport:
        return ProbeReport(enabled, not_python(argv) if enabled else None, off_why=None if enabled else off_why)

    def take(self, record: dict[str, Any]) -> None:
        """One ``probe`` record."""
        pid, state = record.get("pid"), record.get("state")
        if state == "loaded" and isinstance(pid, int):
            self.loaded[pid] = record.get("rank")
        elif state == "failed" and len(self.failures) < MAX_FAILURES:
            self.failures.append({"pid": pid, "rank": record.get("rank"), "detail": str(record.get("detail", ""))})
        elif state == "partial" and isinstance(pid, int):
            self.loaded[pid] = record.get("rank")  # only a loaded probe knows what it left undone
            if len(self.partial) < MAX_FAILURES:
                self.partial.append({"pid": pid, "rank": record.get("rank"), "detail": str(record.get("detail", ""))})

    def as_meta(self) -> dict[str, Any]:
        """The journal meta's ``probe``: state (loaded | failed | off | none), processes, failures, partial, why."""
        if not self.enabled:
            return {"state": "off", "why": self.off_why or "turned off (--no-probe)", "processes": 0, "failures": []}
        ranks = sorted({rank for rank in self.loaded.values() if rank is not None})
        if self.loaded:
            state, why = "loaded", ""
        elif self.failures:
            state, why = "failed", self.failures[0]["detail"]
        else:
            state = "none"
            why = self.command_note or "no process has imported torch and taken an optimizer step yet"
        return {"state": state, "why": why, "processes": len(self.loaded), "ranks": ranks,
                "failures": list(self.failures), **({"partial": list(self.partial)} if self.partial else {})}
