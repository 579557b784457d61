from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from containers import XDIST_GROUP as CONTAINERS
from support import MemoryCgroups

from oomguard.supervisor.observe.cgroup import own_memory_cgroup

# Under pytest-xdist (scripts/test.sh runs `-n 2 --dist loadgroup`) a test goes to whichever process is free,
# except that the tests of one xdist_group run on one process, one after another.
_WIDER = {"module": 1, "package": 2, "session": 3}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that share an expensive fixture (module or session scope: a finished run, a live dashboard, a
    zygote) run on one process, so it is made once, not once per process. The container tests go first: on a
    fresh machine their images take minutes to build, mostly waiting on the network, while the other
    process runs the rest; last, they would be the run's tail."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            shared = _widest_shared_fixture(item)
            if shared is not None:
                item.add_marker(pytest.mark.xdist_group(shared))
    items.sort(key=_order)  # stable: the groups' tests, and the others, stay in the order they were collected


def _order(item: pytest.Item) -> int:
    """The container tests first, then the other groups (their costly fixtures early, short tests last to fill
    in), then the rest; scripts/test.sh keeps this order (--no-loadscope-reorder)."""
    groups = [mark.args[0] for mark in item.iter_markers("xdist_group") if mark.args]
    return 0 if CONTAINERS in groups else 1 if groups else 2


def _widest_shared_fixture(item: pytest.Item) -> str | None:
    """``where::name`` of the widest-scoped fixture of the tests' own that the test uses, if any is wider than
    the test (pytest's own, such as tmp_path_factory, have no ``baseid`` and are cheap)."""
    info = getattr(item, "_fixtureinfo", None)
    found: tuple[int, str] | None = None
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if not defs or not defs[-1].baseid or defs[-1].scope not in _WIDER:
            continue
        wide = (_WIDER[defs[-1].scope], f"{defs[-1].baseid}::{name}")
        found = wide if found is None or wide[0] > found[0] else found
    return None if found is None else found[1]


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
