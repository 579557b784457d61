"""What the in-process probe reports about one attempt: real optimizer steps and the allocator's figures.

Tested in tests/unit/supervisor/observe/test_progress.py (the probe's figures), tests/unit/probe/test_steps.py,
tests/unit/supervisor/record/test_memorylines.py (the breakdowns).

``AllocatorReport`` folds the probe's ``step`` and ``oom`` records: the step reached (the highest
over ranks), the step rate (timed by the lowest rank alone: ranks step together), the allocator's
peaks (what the model allocated, not NVML's view, which adds the context and the cache and misses
short peaks), its limit and its figures at a CUDA OOM. Pure: the loop hands it records. Also here:
whether the probe is in the worker (``ProbeReport``), and what filled memory at an attempt's end
(the journal's ``memory_breakdown`` events).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.common import protocol
from oomguard.supervisor.observe.cgroup import MemoryCgroup
from oomguard.supervisor.observe.sampler import MemorySample, higher


def integer(record: Mapping[str, Any], key: str) -> int | None:
    """A JSON record's integer field (a bool is none)."""
    value = record.get(key)
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
        return cls(device, integer(record, "requested_bytes"), integer(record, "allocated_bytes"),
                   integer(record, "reserved_bytes"), integer(record, "free_bytes"),
                   integer(record, "total_bytes"),
                   float(fraction) if isinstance(fraction, (int, float)) and 0 < fraction < 1 else None,
                   integer(record, "step"), integer(record, "micro_batch"))

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
    """How far the step had got at an OOM, on any device, and what the process held, in one measure (``memory``)."""

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
        limit = integer(record, "total_bytes")
        cuda = AllocatorOom.from_record(record)
        if cuda is not None:
            limit = cuda.limit
        return cls(memory, integer(record, "micro_batch"), integer(record, "requested_bytes"),
                   integer(record, "allocated_bytes"), limit, integer(record, "fixed_bytes"),
                   _fraction_done(record.get("forward_fraction")))


@dataclass
class AllocatorReport:
    """One attempt's ``step`` and ``oom`` records, folded."""

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
        elif kind == protocol.STEP and (step := integer(record, "step")) is not None:
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
                if (value := integer(held, measure)) is not None and value > 0:
                    self.held_after_step[measure] = max(self.held_after_step.get(measure, 0), value)

    def _address_space(self, record: dict[str, Any]) -> None:
        limit, peak = integer(record, "vm_limit_bytes"), integer(record, "vm_peak_bytes")
        if limit and peak:
            self.vm_limit = min(self.vm_limit or limit, limit)
            self.vm_peak = higher(self.vm_peak, peak)

    def _time(self, record: dict[str, Any]) -> None:
        """Steps per second from one process: ranks step together, so adding theirs would count each
        step once per rank. The lowest rank leads; a lower one seen later takes over."""
        rank = integer(record, "rank") or 0
        pid = integer(record, "pid") or 0
        if self.lead is None or rank < self.lead[0]:
            self.lead, self.steps_timed, self.seconds = (rank, pid), 0, 0.0
        if self.lead != (rank, pid):
            return
        steps, seconds = integer(record, "steps"), record.get("seconds")
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
            highest = higher(highest, integer(figures, "allocated_peak"))
            self.reserved_peak = higher(self.reserved_peak, integer(figures, "reserved_peak"))
            if limit := integer(figures, "limit_bytes"):
                self.limit_bytes = min(self.limit_bytes or limit, limit)
        self.allocated_peak = higher(self.allocated_peak, highest)
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


# Whether the probe (oomguard/probe/) is in the worker, and if not, why: for the journal and status.
#
# The probe writes one ``probe`` record per process that trains (state loaded, at its first optimizer
# step), one per failure, and one per part it leaves undone there by design (state partial: under
# ``torch.compile``, docs/probe.md). ``ProbeReport`` folds them into the ``probe`` entry of the journal's
# meta: loaded in N processes, failed with the probe's own words, turned off (--no-probe), or none
# seen yet and the likely reason (a command that is not Python, or no optimizer step taken yet).


MAX_FAILURES = 8  # the first failures are the story; a thousand ranks failing alike are not news


@dataclass
class ProbeReport:
    """What the probe said during one attempt."""

    enabled: bool = True
    command_note: str | None = None  # command.not_python's answer for the attempt's command
    loaded: dict[int, int | None] = field(default_factory=dict)  # pid -> rank
    failures: list[dict[str, Any]] = field(default_factory=list)
    off_why: str | None = None  # why it is off, when not by --no-probe (it failed an earlier attempt)
    partial: list[dict[str, Any]] = field(default_factory=list)  # what it does not do there, by design

    @staticmethod
    def for_command(enabled: bool, command_note: str | None, off_why: str | None = None) -> ProbeReport:
        return ProbeReport(enabled, command_note if enabled else None, off_why=None if enabled else off_why)

    def take(self, record: dict[str, Any]) -> None:
        """One ``probe`` record."""
        pid, state, rank = record.get("pid"), record.get("state"), record.get("rank")
        said = {"pid": pid, "rank": rank, "detail": str(record.get("detail", ""))}
        if state == "loaded" and isinstance(pid, int):
            self.loaded[pid] = rank
        elif state == "failed" and len(self.failures) < MAX_FAILURES:
            self.failures.append(said)
        elif state == "partial" and isinstance(pid, int):
            self.loaded[pid] = rank  # only a loaded probe knows what it left undone
            if len(self.partial) < MAX_FAILURES:
                self.partial.append(said)

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


# What filled memory at an attempt's end: the journal's ``memory_breakdown`` events, one per rank.
#
# The probe splits a rank's memory into weights, gradients, optimizer state, activations and the
# allocator's cache (probe/memory.py) and writes a ``memory`` record at an OOM and at the peak of a
# process that fit. ``BreakdownWatch`` keeps the last record per rank of the running attempt and, when
# the attempt ends, journals them: the OOM's at a memory failure, the peak's otherwise.
#
# A kernel OOM kill (SIGKILL) ends the process before it can say anything, so the watch also keeps the
# supervisor's last reading of every process of the worker's tree and of its memory cgroup (the
# trainer, its DataLoader workers, anything else the cgroup holds: oomguard itself when it runs
# inside), and journals that (``at: "last_reading"``) when a host OOM came without the probe's record.
# Roles are what the processes did: a process that stepped an optimizer (or the worker's own process)
# is a trainer; torch names each DataLoader worker's main thread ``pt_data_worker`` in its worker loop
# (fork, spawn or forkserver alike), which is the process's name in /proc; any other is "other".


EVENT = "memory_breakdown"
MEMORY_KINDS = ("cuda_oom", "host_oom", "memory_limit")  # decide/classify.py's FailureKind values
TRAINER, DATA_LOADER_WORKER, OTHER = "trainer", "data-loader worker", "other"
DATA_LOADER_NAME = "pt_data_worker"  # torch's _worker_loop sets it (torch.multiprocessing._set_thread_name)
_PAGE = os.sysconf("SC_PAGE_SIZE")
# The fields of a probe ``memory`` record the event carries as they are.
FIGURES = ("device", "weights", "frozen_weights", "gradients", "optimizer_state", "optimizers", "activations", "cache",
           "total", "limit", "limit_kind", "measure", "baseline", "requested", "snapshot", "stacks")


def process_reading(pid: int, root: Path = Path("/proc")) -> tuple[str, int] | None:
    """(name, resident bytes) of one process; None once it is gone."""
    try:
        rss = int((root / str(pid) / "statm").read_text().split()[1]) * _PAGE
        name = (root / str(pid) / "comm").read_text().strip()
    except (OSError, ValueError, IndexError):
        return None
    return name, rss


@dataclass
class LastReading:
    """The supervisor's last reading of the worker's processes and of the limit that applied."""

    processes: list[dict[str, Any]]
    total: int | None
    limit: int | None
    limit_kind: str | None
    t: float

    def event(self) -> dict[str, Any]:
        return {"at": "last_reading", "rank": None, "device": "cpu", "weights": None, "frozen_weights": None,
                "gradients": None, "optimizer_state": None, "optimizers": [], "activations": None, "cache": None,
                "total": self.total, "limit": self.limit, "limit_kind": self.limit_kind,
                "processes": self.processes, "read_at": self.t}


@dataclass
class BreakdownWatch:
    """One attempt's breakdowns; ``ended`` journals them (``journal(name, **data)``)."""

    attempt: int = 0
    oom: dict[Any, dict[str, Any]] = field(default_factory=dict)  # rank (or pid) -> its last OOM record
    peak: dict[Any, dict[str, Any]] = field(default_factory=dict)  # rank (or pid) -> its last peak record
    roles: dict[int, str] = field(default_factory=dict)
    last: LastReading | None = None
    history: list[dict[str, Any]] = field(default_factory=list)  # every attempt's events this supervisor journaled
    read: Callable[[int], tuple[str, int] | None] = process_reading

    def _for(self, attempt: int) -> None:
        if attempt != self.attempt:
            self.attempt, self.oom, self.peak, self.roles, self.last = attempt, {}, {}, {}, None

    def take(self, record: dict[str, Any], attempt: int) -> None:
        """One channel record: ``memory`` records are kept; a ``step`` names a trainer."""
        self._for(attempt)
        kind, pid = record.get("type"), record.get("pid")
        if not isinstance(pid, int):
            return
        if kind == protocol.STEP:
            self.roles.setdefault(pid, TRAINER)
        elif kind == protocol.MEMORY and record.get("at") in ("oom", "peak"):
            who = record.get("rank") if isinstance(record.get("rank"), int) else pid
            (self.oom if record["at"] == "oom" else self.peak)[who] = record
            if record["at"] == "oom":
                self.roles.setdefault(pid, TRAINER)

    def sampled(self, sample: MemorySample, attempt: int) -> None:
        """One memory sample of the worker: read each of its processes (and its cgroup's) now."""
        self._for(attempt)
        cgroup = sample.cgroup
        in_cgroup = MemoryCgroup(Path(cgroup.path), cgroup.version).pids() if cgroup else []  # maybe oomguard too
        pids = list(dict.fromkeys([*sample.worker_pids, *in_cgroup]))
        processes: list[dict[str, Any]] = []
        rss = 0
        for pid in pids:
            if (found := self.read(pid)) is not None:
                role = self.roles.get(pid) or (TRAINER if pid == sample.worker_pid else
                                               DATA_LOADER_WORKER if found[0] == DATA_LOADER_NAME else OTHER)
                processes.append({"pid": pid, "role": role, "name": found[0], "rss": found[1]})
                rss += found[1]
        if not any(p["pid"] == sample.worker_pid and p["rss"] > 0 for p in processes):
            # the worker is gone, or being reaped after a kill (its memory already freed: it reads 0; its
            # DataLoader workers may outlive it a moment): the reading before, which still saw it, stays
            return
        if cgroup is not None and cgroup.limit_bytes is not None:
            total, limit, kind = cgroup.counted_bytes, cgroup.limit_bytes, "cgroup"
        else:
            total, limit, kind = rss, None, None
        self.last = LastReading(processes, total, limit, kind, sample.wall)

    def ended(self, kind: str | None, attempt: int, micro_batch: int | None,
              journal: Callable[..., None]) -> list[dict[str, Any]]:
        """Journal (and return) the attempt's breakdowns: the OOM's at a memory failure (``kind``), the
        last reading where the probe said nothing (a kernel kill), the peak's otherwise."""
        self._for(attempt)
        events = self._events(kind)
        for data in events:
            journal(EVENT, attempt=attempt, micro_batch=micro_batch, **data)
        mine = [{"attempt": attempt, "micro_batch": micro_batch, **data} for data in events]
        self.history += mine
        return mine

    def _events(self, kind: str | None) -> list[dict[str, Any]]:
        memory_failure = kind in MEMORY_KINDS
        if memory_failure and self.oom:
            return [_from_record(r, "oom") for r in self.oom.values()]
        if memory_failure:
            return [self.last.event()] if self.last is not None and kind != "cuda_oom" else []
        return [_from_record(r, "peak") for r in self.peak.values()]


def _from_record(record: dict[str, Any], at: str) -> dict[str, Any]:
    return {"at": at, "rank": record.get("rank"), "pid": record.get("pid"),
            **{key: record.get(key) for key in FIGURES}, "processes": None}


def breakdowns(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``memory_breakdown`` events' data among journal events (``Journal.events``' rows)."""
    return [{**e["data"], "attempt": e["data"].get("attempt", e.get("attempt"))} for e in events
            if e.get("kind") == EVENT]
