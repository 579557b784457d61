"""The worker's memory cgroup (v1 or v2): accounting, oomguard's --memory-limit, OOM-kill counters.

The supervisor makes a child cgroup of its own for each attempt's worker. The kernel's oom_kill
counter in it proves a SIGKILL was the OOM killer's; whether the cgroup's own limit was hit tells
oomguard's budget (``memory_limit``) from the machine or a parent cgroup running out (``host_oom``).
Where no cgroup can be made (not root, no memory controller), ``/proc/vmstat`` still counts
OOM kills machine-wide.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_kv(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def vmstat_oom_kills() -> int | None:
    try:
        return _read_kv(Path("/proc/vmstat")).get("oom_kill")
    except OSError:
        return None


def own_memory_cgroup(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT
                      ) -> tuple[Path, int] | None:
    """(directory, version) of this process's memory cgroup, or None without a memory controller."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = root / "memory" / rel.lstrip("/")
            return (v1, 1) if v1.is_dir() else None
    for line in lines:
        if line.startswith("0::"):
            v2 = root / line[3:].lstrip("/")
            available = root / "cgroup.controllers"
            if available.exists() and "memory" in available.read_text().split():
                return v2, 2
    return None


@dataclass
class MemoryCgroup:
    path: Path
    version: int
    limit: int | None = None

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def _file(self, v1: str, v2: str) -> Path:
        return self.path / (v1 if self.version == 1 else v2)

    def set_limit(self, limit: int) -> None:
        self._file("memory.limit_in_bytes", "memory.max").write_text(str(limit))
        if self.version == 2:
            # Kill the whole worker tree together rather than one dataloader process.
            (self.path / "memory.oom.group").write_text("1")
        self.limit = limit

    def oom_kills(self) -> int | None:
        try:
            if self.version == 1:
                return _read_kv(self.path / "memory.oom_control").get("oom_kill")
            return _read_kv(self.path / "memory.events").get("oom_kill")
        except OSError:
            return None

    def limit_hit(self) -> bool:
        """Did usage reach this cgroup's own limit (not a parent's)?"""
        if self.limit is None:
            return False
        try:
            if self.version == 1:
                return int((self.path / "memory.failcnt").read_text()) > 0
            return _read_kv(self.path / "memory.events").get("max", 0) > 0
        except OSError:
            return False

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs.read_text().split()]
        except OSError:
            return []

    def remove(self) -> None:
        """Kill anything left and remove the directory (best effort: a busy cgroup is left)."""
        kill_file = self.path / "cgroup.kill"  # v2 (Linux 5.14+): one atomic kill of the whole tree
        if self.version == 2 and kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                pass
        for _ in range(20):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.05)


def make_worker_cgroup(name: str) -> tuple[MemoryCgroup | None, str]:
    """A child memory cgroup of our own for a worker, or (None, why not)."""
    found = own_memory_cgroup()
    if found is None:
        return None, "no memory cgroup controller"
    parent, version = found
    path = parent / name
    try:
        if path.exists():
            MemoryCgroup(path, version).remove()
        path.mkdir()
        if version == 2:
            # v2 only accounts children whose parent delegates the memory controller.
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+memory")
    except OSError as exc:
        try:
            path.rmdir()
        except OSError:
            pass
        return None, f"cannot create a memory cgroup under {parent}: {exc.strerror}"
    return MemoryCgroup(path, version), ""
