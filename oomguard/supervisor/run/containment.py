"""Where one attempt's worker lives: its own memory cgroup, or the whole machine when none can be made.

The cgroup is what turns a kernel OOM kill into evidence: its ``oom_kill`` counter rises only for
the worker's tree, and ``--memory-limit`` is enforced by the kernel there. Without one (no
controller, not root) the machine-wide counter in /proc/vmstat is the fallback and the limit is
enforced by watching RSS.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oomguard.supervisor.decide.classify import ExitFacts
from oomguard.supervisor.lifecycle.outcome import Stop
from oomguard.supervisor.lifecycle.states import StopReason
from oomguard.supervisor.observe.cgroup import MemoryCgroup, make_worker_cgroup, own_memory_cgroup, vmstat_oom_kills
from oomguard.supervisor.observe.progress import AttemptWatch


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

    def reader(self) -> MemoryCgroup | None:
        """The cgroup the sampler reads (the worker's own), or None without one."""
        return self.cgroup

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


def remove_stale(say: Callable[[str], None]) -> int:
    """Remove the worker cgroups of supervisors that are gone (killed with -9, they could not):
    their name carries the supervisor's pid; a live pid's cgroup is someone else's and is left."""
    found = own_memory_cgroup()
    if found is None:
        return 0
    parent, version = found
    removed = 0
    try:
        entries = list(parent.iterdir())
    except OSError:
        return 0
    for entry in entries:
        match = _STALE.match(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue
        MemoryCgroup(entry, version).remove()
        if not entry.exists():
            removed += 1
    if removed:
        say(f"removed {removed} memory cgroup(s) left by supervisors that were killed")
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
