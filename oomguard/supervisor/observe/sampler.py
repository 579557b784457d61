"""The memory sampler: one ``MemorySample`` of the worker, its cgroup, the host and the GPUs.

``Sampler.sample(worker_pid)``, once per interval, reads the RSS (and CPU time and I/O) of the
worker's whole process tree, the host's memory, the worker's memory cgroup, PSI memory pressure and
the visible GPUs: a few small procfs files and one process-table walk (``bench/watch_cost.py``).
Also here: which rank a process is, the per-attempt peaks (``fold_peak``), and acting before the
crash (``evaluate``: from one sample to what the loop should do).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from oomguard.supervisor.observe.cgroup import CgroupMemory, MemoryCgroup
from oomguard.supervisor.observe.gpu import GpuMonitor, GpuReading
from oomguard.supervisor.units import format_size

# Which rank a process is: torchrun gives every rank ``RANK`` (and ``LOCAL_RANK``) in its environment.


def process_rank(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The global rank of process ``pid`` (its RANK), or None for a process that is no rank or
    whose environment we may not read (read each time: pids are reused)."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    for entry in raw.split(b"\0"):
        if entry.startswith(b"RANK="):
            value = entry[5:].decode(errors="replace")
            return int(value) if value.isdigit() else None
    return None


@dataclass(frozen=True)
class Pressure:
    """PSI memory stall percentages over the last 10 s: ``some`` task / ``full`` (all tasks)."""

    some_avg10: float
    full_avg10: float


def read_pressure(path: Path = Path("/proc/pressure/memory")) -> Pressure | None:
    """PSI figures, or None where the kernel lacks PSI (or it is disabled)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        fields = dict(pair.split("=", 1) for pair in pairs)
        values[kind] = float(fields.get("avg10", "0"))
    return Pressure(values.get("some", 0.0), values.get("full", 0.0))


@dataclass(frozen=True)
class TreeMemory:
    """RSS summed over a process and all its descendants (shared pages counted more than once: PSS
    costs ~100x more to read, and an over-estimate errs safe), and the running totals of their CPU
    time (reaped children's included) and syscall I/O."""

    rss_bytes: int
    pids: tuple[int, ...]
    cpu_seconds: float | None = None
    io_bytes: int | None = None


def tree_memory(pid: int) -> TreeMemory | None:
    """The tree's RSS, or None when ``pid`` is gone; children that exit mid-walk are skipped."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    total, pids, cpu, io = 0, [], 0.0, 0
    cpu_read = io_read = False
    for proc in procs:
        try:
            with proc.oneshot():
                total += proc.memory_info().rss
                times = proc.cpu_times()
                cpu, cpu_read = cpu + times.user + times.system + times.children_user + times.children_system, True
                counters = _io(proc)
                if counters is not None:
                    io, io_read = io + counters, True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # exited or hidden between the walk and the read
        pids.append(proc.pid)
    return TreeMemory(total, tuple(pids), cpu if cpu_read else None, io if io_read else None)


def _io(proc: psutil.Process) -> int | None:
    """Bytes the process read and wrote through syscalls (/proc/PID/io); None where hidden."""
    try:
        counters = proc.io_counters()
    except (psutil.AccessDenied, AttributeError, NotImplementedError):
        return None  # another user's process, or a platform without /proc/PID/io
    return int(getattr(counters, "read_chars", counters.read_bytes) + getattr(counters, "write_chars",
                                                                             counters.write_bytes))


@dataclass(frozen=True)
class MemorySample:
    """Everything the supervisor knows about memory at one moment."""

    monotonic: float
    wall: float
    worker_pid: int | None
    worker_rss_bytes: int | None
    worker_pids: tuple[int, ...]
    host_total_bytes: int
    host_available_bytes: int
    cgroup: CgroupMemory | None
    pressure: Pressure | None
    gpus: tuple[GpuReading, ...] = ()
    gpu_unavailable: str | None = None
    worker_cpu_seconds: float | None = None  # running totals of the worker's tree (TreeMemory)
    worker_io_bytes: int | None = None

    @property
    def worker_gpu_bytes(self) -> int | None:
        """The worker's GPU memory on its busiest device (per-process figure, else device used)."""
        return max((g.worker_or_used for g in self.gpus), default=None)

    def as_row(self) -> dict[str, Any]:
        """Flat columns for the journal and ``status --json`` (GPU figures of the busiest device)."""
        busiest = max(self.gpus, key=lambda g: g.used_bytes, default=None)
        return {
            "t_monotonic": self.monotonic,
            "t_wall": self.wall,
            "worker_pid": self.worker_pid,
            "worker_rss_bytes": self.worker_rss_bytes,
            "host_total_bytes": self.host_total_bytes,
            "host_available_bytes": self.host_available_bytes,
            # counted_bytes: what counts against the limit
            **{f"cgroup_{name}": getattr(self.cgroup, name, None)
               for name in ("usage_bytes", "working_set_bytes", "limit_bytes", "counted_bytes")},
            "psi_some_avg10": self.pressure.some_avg10 if self.pressure else None,
            "psi_full_avg10": self.pressure.full_avg10 if self.pressure else None,
            "gpu_worker_bytes": self.worker_gpu_bytes,
            **{f"gpu_{name}": getattr(busiest, name, None)
               for name in ("used_bytes", "total_bytes", "utilization_pct")},
            "gpu_unavailable": self.gpu_unavailable,
            # every device, with each rank's memory on it (rank read from the process's RANK)
            "gpus": [{"cuda_index": g.cuda_index, "name": g.name, "used_bytes": g.used_bytes,
                      "total_bytes": g.total_bytes, "worker_bytes": g.worker_bytes,
                      "ranks": {str(rank if rank is not None else f"pid {pid}"): used
                                for pid, used in g.worker_processes for rank in [process_rank(pid)]}}
                     for g in self.gpus] or None,
        }


@dataclass
class Sampler:
    """Takes ``MemorySample``s; every source is injectable. ``cgroup``: a fixed reader, else the
    worker's own cgroup, looked up once per worker pid; ``gpu``: None disables GPU sampling."""

    gpu: GpuMonitor | None = field(default_factory=GpuMonitor)
    cgroup: MemoryCgroup | None = None
    pressure_path: Path = Path("/proc/pressure/memory")
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    _found: dict[int | None, MemoryCgroup | None] = field(default_factory=dict, init=False, repr=False)

    def sample(self, worker_pid: int | None) -> MemorySample:
        """One sample of the worker (or of the host alone when ``worker_pid`` is None)."""
        now, wall = self.clock(), self.wall_clock()
        tree = tree_memory(worker_pid) if worker_pid is not None else None
        host = psutil.virtual_memory()
        snapshot = self.gpu.read(tree.pids if tree else ()) if self.gpu else None
        return MemorySample(now, wall, worker_pid, tree.rss_bytes if tree else None, tree.pids if tree else (),
                            host.total, host.available, self._read_cgroup(worker_pid),
                            read_pressure(self.pressure_path), snapshot.devices if snapshot else (),
                            snapshot.unavailable if snapshot else "GPU sampling disabled",
                            tree.cpu_seconds if tree else None, tree.io_bytes if tree else None)

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()

    def _read_cgroup(self, worker_pid: int | None) -> CgroupMemory | None:
        reader = self.cgroup
        if reader is None:
            if worker_pid not in self._found:
                # One lookup per worker: a process does not usually change cgroups mid-run.
                self._found = {worker_pid: MemoryCgroup.for_pid(worker_pid or "self")}
            reader = self._found[worker_pid]
        if reader is None:
            return None
        try:
            return reader.read()
        except (OSError, ValueError):
            return None  # cgroup removed with the worker; the next worker brings its own


@dataclass(frozen=True)
class AttemptPeak:
    """The highest figures one attempt reached; kept for ever by the journal and the fit store."""

    worker_rss_bytes: int = 0
    worker_gpu_bytes: int | None = None
    cgroup_working_set_bytes: int | None = None
    at_wall: float = 0.0


def fold_peak(peak: AttemptPeak | None, sample: MemorySample) -> AttemptPeak:
    """``peak`` raised by ``sample`` (pure; the loop keeps one per attempt)."""
    peak = peak or AttemptPeak()
    rss = max(peak.worker_rss_bytes, sample.worker_rss_bytes or 0)
    cg = sample.cgroup.working_set_bytes if sample.cgroup else None
    return AttemptPeak(rss, higher(peak.worker_gpu_bytes, sample.worker_gpu_bytes),
                       higher(peak.cgroup_working_set_bytes, cg),
                       sample.wall if rss > peak.worker_rss_bytes else peak.at_wall)


def higher(old: int | None, new: int | None) -> int | None:
    """The larger of two figures where one may be unknown."""
    if new is None:
        return old
    return new if old is None else max(old, new)


# Acting before the crash: a pure function from one memory sample to what the loop should do.
#
# ``evaluate(sample, thresholds, checkpoint_pending)`` returns a ``MemoryVerdict``:
#
# - ``STOP`` (hard): the worker's process tree is over ``--memory-limit``. The loop stops it cleanly
#   (SIGTERM, grace, SIGKILL) and records a ``memory_limit`` failure, so the kernel's OOM killer never
#   has to pick a victim (it may pick the user's shell, tmux or the supervisor).
# - ``CHECKPOINT`` (soft): some budget is at or above ``--soft-threshold`` (GPU memory, the
#   ``--memory-limit``, the cgroup limit, the host's RAM) or PSI is above ``--psi-threshold``. The
#   loop asks the worker to checkpoint now; a request already pending is not repeated.
# - ``NONE``.
#
# No I/O, no clock: the tests feed it samples.


class MemoryAction(enum.Enum):
    """What the loop should do about memory now."""

    NONE = "none"
    CHECKPOINT = "checkpoint"  # ask the worker to save now (signal + request file)
    STOP = "stop"  # stop the worker as a memory_limit failure


@dataclass(frozen=True)
class Thresholds:
    """The memory thresholds; validated here so the CLI and the TOML file share the messages."""

    soft_fraction: float = 0.95  # --soft-threshold, of each budget
    psi_some_avg10: float | None = None  # --psi-threshold: % of the last 10 s some task stalled; None: off
    memory_limit_bytes: int | None = None  # --memory-limit, the hard cap on the worker tree's RSS

    def __post_init__(self) -> None:
        soft, psi, limit = self.soft_fraction, self.psi_some_avg10, self.memory_limit_bytes
        if not 0.0 < soft <= 1.0:
            hint = f"; for {soft:g}% write {soft / 100:g} or {soft:g}%" if 1 < soft <= 100 else ""
            raise ValueError(f"--soft-threshold must be a fraction in (0, 1], e.g. 0.95, got {soft:g}{hint}")
        if psi is not None and not 0.0 < psi <= 100.0:
            raise ValueError(f"--psi-threshold is the percent of time stalled on memory, in (0, 100], e.g. 20; "
                             f"got {psi:g} (leave it out to disable the PSI trigger)")
        if limit is not None and limit <= 0:
            raise ValueError(f"--memory-limit must be a positive size such as 16G or 800M, got {limit} bytes"
                             " (leave it out for no limit)")


def parse_fraction(text: str) -> float:
    """``--soft-threshold``'s text: ``0.95`` or ``95%``; raises ValueError naming the option."""
    raw = text.strip()
    try:
        return float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"--soft-threshold must be a fraction like 0.95 or a percentage like 95%, got {text!r}"
                         ) from None


@dataclass(frozen=True)
class MemoryVerdict:
    """The decision and its evidence (the figure that decided, for the journal and status)."""

    action: MemoryAction
    reason: str = ""
    evidence: str = ""


def evaluate(sample: MemorySample, thresholds: Thresholds, checkpoint_pending: bool) -> MemoryVerdict:
    """What to do about ``sample``: stop beats checkpoint beats nothing."""
    hard = _hard_limit(sample, thresholds)
    if hard is not None:
        return hard
    soft = _soft_trigger(sample, thresholds)
    if soft is None:
        return MemoryVerdict(MemoryAction.NONE)
    if checkpoint_pending:
        # The worker is (or should be) saving already; a second signal would only interrupt it.
        return MemoryVerdict(MemoryAction.NONE, "checkpoint request already pending", soft.evidence)
    return soft


def _hard_limit(sample: MemorySample, thresholds: Thresholds) -> MemoryVerdict | None:
    limit, rss = thresholds.memory_limit_bytes, sample.worker_rss_bytes
    if limit is None or rss is None or rss < limit:
        return None
    return MemoryVerdict(MemoryAction.STOP, "memory_limit",
                         f"worker tree RSS {format_size(rss)} >= --memory-limit {format_size(limit)} "
                         f"(pids {_pids(sample)})")


def _soft_trigger(sample: MemorySample, thresholds: Thresholds) -> MemoryVerdict | None:
    """The first budget at or over the soft fraction, or PSI over its level."""
    for label, used, budget in _budgets(sample, thresholds):
        if budget > 0 and used >= thresholds.soft_fraction * budget:
            return MemoryVerdict(MemoryAction.CHECKPOINT, "soft_threshold",
                                 f"{label} {format_size(used)} of {format_size(budget)} = {used / budget:.1%}"
                                 f" >= --soft-threshold {thresholds.soft_fraction:.0%}")
    psi = sample.pressure
    level = thresholds.psi_some_avg10
    if level is not None and psi is not None and psi.some_avg10 >= level:
        return MemoryVerdict(MemoryAction.CHECKPOINT, "memory_pressure",
                             f"PSI memory some avg10 {psi.some_avg10:.1f}% >= --psi-threshold {level:g}%")
    return None


def _budgets(sample: MemorySample, thresholds: Thresholds) -> list[tuple[str, int, int]]:
    """(label, used, budget) for every budget the sample lets us judge."""
    # The whole device counts, not only the worker's share: another process filling the
    # GPU makes the worker's next allocation fail just the same.
    budgets = [(f"GPU {g.cuda_index} ({g.name}) used", g.used_bytes, g.total_bytes) for g in sample.gpus]
    if thresholds.memory_limit_bytes is not None and sample.worker_rss_bytes is not None:
        budgets.append(("worker tree RSS", sample.worker_rss_bytes, thresholds.memory_limit_bytes))
    cg = sample.cgroup
    if cg is not None and cg.limit_bytes is not None:
        budgets.append((f"cgroup {cg.path} working set", cg.working_set_bytes, cg.limit_bytes))
    in_use = sample.host_total_bytes - sample.host_available_bytes
    budgets.append(("host memory in use", in_use, sample.host_total_bytes))
    return budgets


def _pids(sample: MemorySample) -> str:
    shown = ",".join(str(p) for p in sample.worker_pids[:8])
    return shown + (",..." if len(sample.worker_pids) > 8 else "")
