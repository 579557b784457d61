"""Memory cgroups (v1 or v2), one class: the worker's own (accounting, oomguard's --memory-limit,
OOM-kill counters) and any other oomguard reads (the figures of ``MemoryCgroup.read``).

Tested in tests/unit/supervisor/observe/test_sampler.py and tests/e2e/test_spare_budget.py (real cgroups).

The kernel's oom_kill counter in the worker's own cgroup proves a SIGKILL was the OOM killer's, and
whether its own limit was hit tells ``memory_limit`` from ``host_oom``; without a cgroup,
``/proc/vmstat`` still counts OOM kills machine-wide.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number; anything this big
# is no limit, whatever the page size.
_V1_UNLIMITED = 2**62
_USAGE = {1: "memory.usage_in_bytes", 2: "memory.current"}  # a memory cgroup's usage file, by version


@dataclass(frozen=True)
class CgroupMemory:
    """A memory cgroup's figures. Budgets compare the working set (usage less inactive file cache, which
    the kernel reclaims before any OOM kill), as Kubernetes and Docker do."""

    path: str
    version: int
    usage_bytes: int
    working_set_bytes: int
    limit_bytes: int | None  # the tightest limit up to the hierarchy's root; None when unlimited
    oom_kills: int | None
    limit_working_set_bytes: int | None = None  # of the cgroup that sets that limit: what counts against it

    @property
    def counted_bytes(self) -> int:
        """The memory counted against ``limit_bytes``: the limiting cgroup's working set when known."""
        return self.limit_working_set_bytes if self.limit_working_set_bytes is not None else self.working_set_bytes


def vmstat_oom_kills() -> int | None:
    return _stat_field(Path("/proc/vmstat"), "oom_kill")


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
    """One memory cgroup directory (v1 or v2): the worker's own, which oomguard makes, limits (``limit``)
    and removes, or any other it only reads (the one a process is in, a parent that sets a limit)."""

    path: Path
    version: int
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.version not in (1, 2):
            raise ValueError(f"cgroup version must be 1 or 2, not {self.version}")
        self.path = Path(self.path)

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
        return _stat_field(self._file("memory.oom_control", "memory.events"), "oom_kill")

    def limit_hit(self) -> bool:
        """Did usage reach this cgroup's own limit (not a parent's)?"""
        if self.limit is None:
            return False
        try:
            if self.version == 1:
                return int((self.path / "memory.failcnt").read_text()) > 0
            return (_stat_field(self.path / "memory.events", "max") or 0) > 0
        except OSError:
            return False

    def read(self) -> CgroupMemory:
        """Current figures; raises OSError when the cgroup is gone."""
        usage, working = self._usage(self.path)
        limit, where = self._limit()
        return CgroupMemory(str(self.path), self.version, usage, working, limit, self.oom_kills(),
                            self._counted(where, working))

    def _counted(self, where: Path | None, working: int) -> int | None:
        """The working set of the cgroup that sets the limit (None when it cannot be read)."""
        if where is None or where == self.path:
            return working
        try:
            return self._usage(where)[1]
        except (OSError, ValueError):  # a limit set where usage is not readable: the worker's own figure stands
            return None

    def _usage(self, node: Path) -> tuple[int, int]:
        """(usage, working set) of one cgroup directory; a parent's figures include its children."""
        usage = int((node / _USAGE[self.version]).read_text().split()[0])
        inactive = _stat_field(node / "memory.stat", "total_inactive_file" if self.version == 1 else "inactive_file")
        return usage, max(0, usage - (inactive or 0))

    def _limit(self) -> tuple[int | None, Path | None]:
        """The tightest limit from this cgroup upwards (a parent's binds its children too), and the
        cgroup that sets it; up to where the control file ends (v2's root, v1's mount point)."""
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        tightest: tuple[int | None, Path | None] = (None, None)
        node = self.path
        while (node / name).exists() and node.parent != node:
            limit = _parse_limit((node / name).read_text())
            if limit is not None and (tightest[0] is None or limit < tightest[0]):
                tightest = (limit, node)
            node = node.parent
        return tightest

    @classmethod
    def for_pid(cls, pid: int | str = "self", proc: Path = Path("/proc")) -> MemoryCgroup | None:
        """The memory cgroup that ``pid`` belongs to, or None when there is none to read."""
        try:
            membership = (proc / str(pid) / "cgroup").read_text()
            mounts = (proc / str(pid) / "mountinfo").read_text()
        except OSError:
            return None
        return locate_cgroup(membership, mounts)

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
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.05)


def locate_cgroup(membership: str, mountinfo: str) -> MemoryCgroup | None:
    """A reader for the memory cgroup named in ``/proc/PID/cgroup``, found via ``mountinfo``: v1's
    ``memory`` controller where mounted (a hybrid host's v2 tree has none), else v2's."""
    v1_mount, v2_mount = _memory_mounts(mountinfo)
    for line in membership.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if v1_mount is not None and "memory" in controllers.split(","):
            return _reader(v1_mount, rel, 1)
        if v2_mount is not None and hierarchy == "0" and controllers == "":
            found = _reader(v2_mount, rel, 2)
            if found is not None and v1_mount is None:
                return found
    return None


def _memory_mounts(mountinfo: str) -> tuple[tuple[Path, str] | None, tuple[Path, str] | None]:
    """((v1 memory mount point, its root), (v2 mount point, its root)) from mountinfo."""
    v1 = v2 = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        entry = (Path(fields[4]), fields[3])
        if tail[0] == "cgroup" and "memory" in tail[2].split(","):
            v1 = entry
        elif tail[0] == "cgroup2" and v2 is None:
            v2 = entry
    return v1, v2


def _reader(mount: tuple[Path, str], rel: str, version: int) -> MemoryCgroup | None:
    point, root = mount
    # Inside a cgroup namespace the mount's root is the container's cgroup and paths are
    # relative to it; outside, strip the mount's root from the absolute path.
    if root != "/" and rel.startswith(root):
        rel = rel[len(root) :]
    path = point / rel.lstrip("/")
    return MemoryCgroup(path, version) if (path / _USAGE[version]).exists() else None


def _parse_limit(text: str) -> int | None:
    text = text.strip()
    if text == "max":
        return None
    value = int(text)
    return None if value >= _V1_UNLIMITED else value


def _stat_field(path: Path, key: str) -> int | None:
    """``key``'s value in a flat "key value" file, or None when the file or key is missing."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except OSError:
        return None
    return None


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


@dataclass(frozen=True)
class SharedLimit:
    """The tightest cgroup limit above oomguard's own cgroup, which holds the worker's cgroup and
    every spare's (siblings under it: ``make_worker_cgroup``), and the working set counted against it."""

    limit_bytes: int
    counted_bytes: int
    path: str


def shared_limit(own: MemoryCgroup | None = None) -> SharedLimit | None:
    """The limit that holds the worker and its spares together: the tightest of oomguard's own cgroup
    and its ancestors (not ``--memory-limit``, which is the worker's own); None when there is none."""
    own = own if own is not None else MemoryCgroup.for_pid("self")
    if own is None:
        return None
    try:
        limit, where = own._limit()
        if limit is None or where is None:
            return None
        return SharedLimit(limit, own._usage(where)[1], str(where))
    except (OSError, ValueError):
        return None
