"""Where one attempt's worker lives: its own memory cgroup, or the whole machine when none can be made.

The cgroup is what turns a kernel OOM kill into evidence: its ``oom_kill`` counter rises only for
the worker's tree, and ``--memory-limit`` is enforced by the kernel there. Without one (no
controller, not root) the machine-wide counter in /proc/vmstat is the fallback and the limit is
enforced by watching RSS. ``Handover`` restarts only onto free memory (see below).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from oomguard.supervisor.decide.classify import ExitFacts
from oomguard.supervisor.lifecycle import Stop, StopReason
from oomguard.supervisor.observe.cgroup import MemoryCgroup, make_worker_cgroup, own_memory_cgroup, vmstat_oom_kills
from oomguard.supervisor.observe.gpu import GpuMonitor, GpuSnapshot
from oomguard.supervisor.observe.progress import AttemptWatch
from oomguard.supervisor.record.logs import say as log


@dataclass
class Containment:
    cgroup: MemoryCgroup | None
    why_none: str = ""
    oom_kills_before: int | None = None

    @classmethod
    def create(cls, name: str, memory_limit: int | None) -> Containment:
        """A fresh cgroup for the next attempt; the OOM-kill counter is read before it starts."""
        cgroup, why = make_worker_cgroup(name)
        if cgroup is not None and memory_limit:
            cgroup.set_limit(memory_limit)
        made = cls(cgroup, why)
        made.oom_kills_before = made.oom_kills()
        return made

    def oom_kills(self) -> int | None:
        return self.cgroup.oom_kills() if self.cgroup else vmstat_oom_kills()

    @property
    def procs(self) -> Path | None:
        """The file a process writes its pid to, to join the cgroup (the launcher does)."""
        return self.cgroup.procs if self.cgroup else None

    def exit_facts(self, returncode: int, watch: AttemptWatch, stop: Stop | None) -> ExitFacts:
        """Everything classification needs about how the attempt ended, and why oomguard stopped it."""
        cgroup = self.cgroup
        why = stop.detail if stop is not None else None
        return ExitFacts(returncode, self.oom_kills_before, self.oom_kills(),
                         f"cgroup {cgroup.path}" if cgroup else "/proc/vmstat",
                         limit_hit=cgroup.limit_hit() if cgroup else False,
                         stopped_for_memory=why if stop is not None and stop.reason is StopReason.MEMORY else None,
                         hung=why if stop is not None and stop.reason is StopReason.HANG else None,
                         worker_failure=watch.worker_failure)

    def remove(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()


_STALE = re.compile(r"^oomguard-(\d+)-(?:worker|spare-\d+)$")  # spare-N: run/spare.py


def remove_stale() -> None:
    """Remove the worker cgroups left by supervisors killed with -9 (their pid is in the name)."""
    found = own_memory_cgroup()
    if found is None:
        return
    parent, version = found
    removed = 0
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _STALE.match(entry.name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        MemoryCgroup(entry, version).remove()
        if not entry.exists():
            removed += 1
    if removed:
        log(f"removed {removed} memory cgroup(s) left by supervisors that were killed")


# Restart only onto free memory: before the next attempt, the last one's processes are gone and
# its GPU memory is back.
#
# A rank's data-loader children, or a CUDA context still being torn down, can hold GPU memory for
# seconds after the attempt ended; an attempt started onto that memory fails at once and would be
# halved for memory that was never really short. NVIDIA's fault-tolerance launcher polls NVML
# every 2 s for up to 50 s and then starts anyway, only logging who holds memory. Here the holders
# are known (the old attempt's process tree, each remembered with its start time so a reused pid is
# never hit, and its cgroup), so they are named and ended first; then NVML is polled until none of
# them is on a GPU and every device's used memory is back near its level before the attempt.


POLL = 0.5  # seconds between NVML readings while waiting
TOLERANCE = 512 * 2**20  # used memory this close to the level before the attempt counts as back


@dataclass
class AttemptProcesses:
    """Every process seen in an attempt's tree: pid -> start time (pids are reused; times are not)."""

    seen: dict[int, float] = field(default_factory=dict)

    def add(self, procs: Iterable[psutil.Process]) -> None:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                self.seen.setdefault(proc.pid, proc.create_time())

    def alive(self, extra: Iterable[int] = ()) -> list[psutil.Process]:
        """Those still running (zombies aside), plus ``extra`` pids (the cgroup's members)."""
        out = []
        for pid in {*self.seen, *extra}:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if pid in self.seen and abs(proc.create_time() - self.seen[pid]) > 0.01:
                    continue  # the pid now belongs to someone else
                if proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
        return out


def end(procs: Iterable[psutil.Process]) -> list[str]:
    """SIGKILL the old attempt's leftovers (its worker already exited: nothing to save); their names."""
    named = []
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            named.append(f"{proc.pid} ({' '.join(proc.cmdline())[:80] or proc.name()})")
            os.kill(proc.pid, signal.SIGKILL)
    psutil.wait_procs(list(procs), timeout=5)
    return named


@dataclass(frozen=True)
class Settled:
    waited: float
    settled: bool
    holding: str  # who still held GPU memory when the wait ended ("" when it settled)


def wait_for_gpus(read: Callable[[Collection[int]], GpuSnapshot], old_pids: Iterable[int],
                  baseline: Mapping[int, int], timeout: float) -> Settled:
    """Poll NVML until no ``old_pids`` is on a GPU and each device is near ``baseline``, or ``timeout``."""
    pids = list(old_pids)
    start = time.monotonic()
    while True:
        holding = _holding(read(pids), baseline)
        if not holding or time.monotonic() - start >= timeout:
            return Settled(time.monotonic() - start, not holding, holding)
        time.sleep(POLL)


def _holding(snap: GpuSnapshot, baseline: Mapping[int, int]) -> str:
    parts = []
    for gpu in snap.devices:
        ours = [str(pid) for pid, _ in gpu.worker_processes]
        if ours:
            parts.append(f"GPU {gpu.cuda_index}: old attempt's pids {','.join(ours)}")
        elif gpu.used_bytes > baseline.get(gpu.cuda_index, gpu.used_bytes) + TOLERANCE:
            extra = (gpu.used_bytes - baseline[gpu.cuda_index]) / 2**30
            parts.append(f"GPU {gpu.cuda_index}: {extra:.1f} GiB more in use than before the attempt")
    return "; ".join(parts)


@dataclass
class Handover:
    """Between attempts: the last one's leftovers ended, its GPU memory back, then a fresh cgroup."""

    event: Callable[..., None]
    containment: Containment | None = None  # the current attempt's cgroup
    procs: AttemptProcesses = field(default_factory=AttemptProcesses)  # the current attempt's, as sampled
    _gpu_baseline: dict[int, int] = field(default_factory=dict)  # GPU memory used per device before the last attempt

    def next_containment(self, name: str, memory_limit: int | None, gpu: GpuMonitor | None,
                 settle_timeout: float, adopt: Containment | None = None) -> Containment:
        """``adopt``: the cgroup a spare interpreter already lives in (``run/spare.py``)."""
        self._settle(gpu, settle_timeout)
        self.remove()
        self.containment = adopt or Containment.create(name, memory_limit)
        self.procs = AttemptProcesses()
        return self.containment

    def remove(self) -> None:
        if self.containment is not None:
            self.containment.remove()

    def _settle(self, gpu: GpuMonitor | None, timeout: float) -> None:
        """End the last attempt's leftovers, wait (bounded) for NVML to show its GPU memory freed, and note
        each device's level before the next attempt."""
        containment = self.containment
        cgroup = containment.cgroup if containment is not None else None
        leftovers = self.procs.alive(cgroup.pids() if cgroup is not None else [])
        if leftovers:
            named = end(leftovers)
            self.event("leftovers_ended", processes=named)
            log(f"ended the last attempt's leftover processes: {', '.join(named)}")
        if gpu is None:
            return
        if self._gpu_baseline and self.procs.seen:
            done = wait_for_gpus(gpu.read, self.procs.seen, self._gpu_baseline, timeout)
            self.event("memory_settled" if done.settled else "memory_not_settled", waited=round(done.waited, 2),
                        holding=done.holding)
            if not done.settled:
                log(f"starting anyway after {done.waited:.0f} s: GPU memory still held ({done.holding})")
        self._gpu_baseline = {g.cuda_index: g.used_bytes for g in gpu.read(()).devices}
