from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import MemoryCgroups

from oomguard.supervisor.observe.cgroup import own_memory_cgroup

# Under pytest-xdist scripts/test.sh runs `-n 2 --dist loadfile --no-loadscope-reorder`: the tests of one file run
# on one process (a module-scoped fixture, such as a finished run or a zygote, is made once), and the files go out
# in the order collected. Not loadgroup: pytest 9.2 ignores the test ids it rewrites to carry the groups
# (pytest-dev/pytest-xdist#1386), and every test then goes out on its own.
FIRST = "tests/e2e/test_docker.py"
# Then the files that took longest in the last CI run (minutes each), so that neither process takes one up
# near the end while the other runs out of work: the unit tests, seconds each, come last and fill in.
SLOWEST = ("tests/e2e/test_slurm.py", "tests/e2e/test_probe_matrix_frameworks.py", "tests/e2e/test_probe_matrix.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/e2e/test_docker.py first: on a fresh machine its image (and the Debian base that
    tests/e2e/test_systemd_pid1.py builds on too) takes minutes, mostly waiting on the network, while the other
    process runs the rest; collected in its place, it could run beside the systemd file on the other process,
    both then waiting on one build lock, or come last and be the run's tail. The SLOWEST files next."""
    order = (FIRST, *SLOWEST)

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return order.index(path) if path in order else len(order)

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def fit_store_per_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What earlier runs learned lives in a cache; each test starts with an empty one."""
    cache = tmp_path / "oomguard-cache"
    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def memory_cgroup() -> Iterator[MemoryCgroups]:
    """Makes real memory cgroups (v1 or v2) under this process's own memory cgroup, each with a limit, for a test
    to put oomguard itself into (``echo $$ > PATH/cgroup.procs && exec ...``); all removed after the test.

    ``make(limit_bytes, name="oomguard-test")`` returns the directory ``NAME-PID-N``. The test is skipped where
    there is no memory controller or a cgroup cannot be made or limited (not root, a read-only cgroupfs).
    """
    found = own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup controller on this machine")
    parent, version = found
    limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
    made: list[Path] = []

    def make(limit_bytes: int, name: str = "oomguard-test") -> Path:
        path = parent / f"{name}-{os.getpid()}-{len(made)}"
        try:
            path.mkdir()
        except OSError as exc:
            pytest.skip(f"cannot create a memory cgroup under {parent}: {exc}")
        made.append(path)  # removed after the test even if its limit cannot be set
        try:
            (path / limit_file).write_text(str(limit_bytes))
        except OSError as exc:
            pytest.skip(f"cannot set {limit_file} of a memory cgroup under {parent}: {exc}")
        return path

    yield make
    for path in reversed(made):
        for _ in range(50):  # rmdir fails while a process the kernel killed in it is still being reaped
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)
