"""What filled memory at an attempt's end: the journal's ``memory_breakdown`` events, one per rank.

The probe splits a rank's memory into weights, gradients, optimizer state, activations and the
allocator's cache (probe/memsplit.py) and writes a ``memory`` record at an OOM and at the peak of a
process that fit. ``BreakdownWatch`` keeps the last record per rank of the running attempt and, when
the attempt ends, journals them: the OOM's at a memory failure, the peak's otherwise.

A kernel OOM kill (SIGKILL) ends the process before it can say anything, so the watch also keeps the
supervisor's last reading of every process of the worker's tree and of its memory cgroup (the
trainer, its DataLoader workers, anything else the cgroup holds: oomguard itself when it runs
inside), and journals that (``at: "last_reading"``) when a host OOM came without the probe's record.
Roles are what the processes did: a process that stepped an optimizer (or the worker's own process)
is a trainer; torch names each DataLoader worker's main thread ``pt_data_worker`` in its worker loop
(fork, spawn or forkserver alike), which is the process's name in /proc; any other is "other".
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.common import protocol
from oomguard.supervisor.observe.sampler import MemorySample

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


def cgroup_pids(path: str | None) -> list[int]:
    """Every process of the memory cgroup at ``path`` (the worker's, maybe oomguard too)."""
    if not path:
        return []
    try:
        return [int(line) for line in Path(path, "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


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
        pids = list(dict.fromkeys([*sample.worker_pids, *cgroup_pids(cgroup.path if cgroup else None)]))
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
        """Journal the attempt's breakdowns: the OOM's at a memory failure (the last reading where the
        probe said nothing: a kernel kill), the peak's otherwise. ``kind``: how it failed (FailureKind's
        value), None when it did not. Returns what it journaled."""
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
