"""Spares use only memory the run can spare (issue 35 part 3): the policy on scripted figures
(decide/policy.py), the limit above the worker and its spares read from cgroup trees
(observe/cgroup.py, v1 real and v2 fake), the keeper (run/spare.py) holding a spare back and saying
why once, and what the kernel's OOM killer really does in a memory cgroup that holds a worker and
an idle spare."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from oomguard.supervisor.decide.policy import (
    MARGIN_MIN,
    SPARE_GUESS,
    Limit,
    WorkerMemory,
    spare_room,
    worker_score,
)
from oomguard.supervisor.observe.cgroup import MemoryCgroup, SharedLimit, own_memory_cgroup, shared_limit
from oomguard.supervisor.run.spare import Spares

MIB, GIB = 1 << 20, 1 << 30
PY = sys.executable


# ----- the policy, on scripted figures


def test_a_known_peak_leaves_room_for_a_spare_only_above_its_margin() -> None:
    limit = Limit(int(1.5 * GIB), 1_000 * MIB, "the cgroup limit", True)
    worker = WorkerMemory(now=900 * MIB, peak=1_000 * MIB)  # 100 MiB of others: oomguard itself
    spare = 376 * MIB
    # 1536 - 100 others - 1000 peak - 100 margin = 336 MiB of room: not a 376 MiB spare
    why = spare_room(limit, worker, 0, spare)
    assert why == ("the cgroup limit 1.50 GiB leaves 0.33 GiB above its peak 0.98 GiB and a margin; "
                   "a spare needs 0.37 GiB")
    roomy = Limit(2 * GIB, 1_000 * MIB, "the cgroup limit", True)  # 848 MiB of room
    assert spare_room(roomy, worker, 0, spare) == ""
    assert spare_room(roomy, worker, 0, 3 * spare) != ""
    held = Limit(int(1.8 * GIB), 1_000 * MIB + spare, "the cgroup limit", True)  # one running already
    assert "the spares held (0.37 GiB)" in spare_room(held, worker, spare, spare)
    assert spare_room(held, worker, spare, spare, running=True) == ""  # the one running still fits


def test_the_margin_is_a_tenth_of_the_peak_and_never_below_its_floor() -> None:
    small = WorkerMemory(now=100 * MIB, peak=100 * MIB)
    assert small.need() == 100 * MIB + MARGIN_MIN
    big = WorkerMemory(now=4 * GIB, peak=10 * GIB)
    assert big.need() == 11 * GIB
    assert WorkerMemory(now=12 * GIB, peak=10 * GIB).need() == int(13.2 * GIB)  # grown past the peak seen
    limit = Limit(12 * GIB, 4 * GIB, "the cgroup limit", True)
    assert spare_room(limit, big, 0, GIB - 1) == "" and spare_room(limit, big, 0, GIB + 1) != ""


def test_before_the_peak_is_known_a_cgroup_limit_keeps_a_quarter_and_four_spares_free() -> None:
    worker = WorkerMemory(now=400 * MIB)
    job = Limit(int(1.5 * GIB), 500 * MIB, "the cgroup limit", True)
    why = spare_room(job, worker, 0, SPARE_GUESS)
    assert why.startswith("the worker's peak is not known yet and the cgroup limit 1.50 GiB has 1.01 GiB free")
    big = Limit(16 * GIB, 500 * MIB, "the cgroup limit", True)  # 15.5 GiB free: a quarter and 2 GiB stay
    assert spare_room(big, worker, 0, SPARE_GUESS) == ""
    host = Limit(2 * GIB, 1 * GIB, "the host's memory", False)  # the host's own rules apply there
    assert spare_room(host, worker, 0, SPARE_GUESS) == ""


def test_memory_limit_bounds_the_worker_before_its_peak_is_known() -> None:
    worker = WorkerMemory(now=300 * MIB, bound=GIB)
    limit = Limit(2 * GIB, 400 * MIB, "the cgroup limit", True)  # 100 MiB others
    assert spare_room(limit, worker, 0, 900 * MIB) == ""  # 2048 - 100 - 1024 = 924 MiB
    assert "above --memory-limit 1.00 GiB" in spare_room(limit, worker, 0, 950 * MIB)


# ----- the limit that holds the worker and its spares, read from cgroup trees


def fake_tree(root: Path, version: int, limits: list[str], usage: list[int]) -> Path:
    """Nested cgroup directories root/a/b/...: ``limits`` and ``usage`` from the top down."""
    limit_file, usage_file = ("memory.limit_in_bytes", "memory.usage_in_bytes") if version == 1 else \
        ("memory.max", "memory.current")
    node = root
    for depth, (limit, used) in enumerate(zip(limits, usage, strict=True)):
        node = node / f"level{depth}"
        node.mkdir(parents=True)
        (node / limit_file).write_text(limit + "\n")
        (node / usage_file).write_text(f"{used}\n")
        inactive = "total_inactive_file" if version == 1 else "inactive_file"
        (node / "memory.stat").write_text(f"{inactive} {10 * MIB}\n")
    return node


@pytest.mark.parametrize("version,unlimited", [(2, "max"), (1, str(2**63 - 4096))])
def test_the_tightest_ancestor_limit_and_its_working_set(tmp_path: Path, version: int, unlimited: str) -> None:
    # a Slurm job's 1.5 GiB two levels above oomguard's own cgroup; a looser one above it
    own = fake_tree(tmp_path, version, [str(8 * GIB), str(int(1.5 * GIB)), unlimited, unlimited],
                    [3 * GIB, 900 * MIB, 800 * MIB, 700 * MIB])
    found = shared_limit(MemoryCgroup(own, version))
    assert found == SharedLimit(int(1.5 * GIB), 890 * MIB, str(own.parent.parent))


@pytest.mark.parametrize("version,unlimited", [(2, "max"), (1, str(2**63 - 4096))])
def test_no_limit_above_is_none(tmp_path: Path, version: int, unlimited: str) -> None:
    own = fake_tree(tmp_path, version, [unlimited, unlimited], [GIB, GIB])
    assert shared_limit(MemoryCgroup(own, version)) is None


def test_this_machines_own_cgroup_is_read(memory_cgroup: Any) -> None:
    """A real v1 (or v2) cgroup with a limit, and a child in it as oomguard's own: the child sees its
    parent's limit and the parent's usage."""
    parent = memory_cgroup(700 * MIB, "oomguard-budget")
    child = parent / "own"
    child.mkdir()
    try:
        found = own_memory_cgroup()
        assert found is not None
        limit = shared_limit(MemoryCgroup(child, found[1]))
        assert limit is not None and limit.limit_bytes == 700 * MIB and limit.path == str(parent)
    finally:
        child.rmdir()


# ----- the keeper: a spare held back, said once


class Figures:
    def __init__(self, limit: SharedLimit | None) -> None:
        self.limit = limit

    def __call__(self) -> SharedLimit | None:
        return self.limit


def test_the_keeper_holds_a_spare_back_and_says_why_once(tmp_path: Path) -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    said: list[dict[str, object] | None] = []
    figures = Figures(SharedLimit(int(1.5 * GIB), 1_300 * MIB, "/job"))
    spares = Spares(True, tmp_path / "run", tmp_path, None, lambda name, **data: log.append((name, data)),
                    memory=lambda: (20 * GIB, 24 * GIB), limit=figures, say=said.append)
    (tmp_path / "train.py").write_text("print('hi')\n")
    try:
        spares.observe(1_200 * MIB, trained=True)
        spares.prepare([PY, "train.py"], dict(os.environ))
        for _ in range(3):
            spares.tick()
        assert spares.pool == []
        assert [name for name, _ in log] == ["spare_held_back"]  # once, however many ticks
        assert said == [{"state": "not started", "why": log[0][1]["why"]}]
        assert log[0][1]["why"].startswith("the cgroup limit 1.50 GiB leaves 0.11 GiB above its peak 1.17 GiB")
        figures.limit = None  # the job's limit lifted: the host's memory, with room
        spares.tick()
        assert spares.pool and said[-1] is None and log[-1][0] == "spare_started"
        figures.limit = SharedLimit(1_300 * MIB, 1_300 * MIB, "/job")  # the worker grew into their room
        for _ in range(3):
            spares.tick()
        assert spares.pool == [] and [name for name, _ in log].count("spare_held_back") == 1
        assert said[-1] is not None and str(said[-1]["why"]).startswith("the cgroup limit 1.27 GiB leaves 0.00 GiB")
        assert [name for name, _ in log][-1] == "spare_not_used"
    finally:
        spares.discard()


# ----- what the kernel does: a real memory cgroup that holds a worker and an idle spare

HOLD = """import os, sys, time
procs, adj, target, step, wait = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
open("/proc/self/oom_score_adj", "w").write(adj)
open(procs, "w").write(str(os.getpid()))
held = []
while sum(map(len, held)) < target << 20:
    block = bytearray(step << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1  # touched: resident, counted by the cgroup
    held.append(block)
print("reached", flush=True)
time.sleep(wait)
"""


@pytest.fixture
def job(memory_cgroup: Any, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A job's cgroup (600 MiB, as Slurm's --mem) with oomguard's layout: the worker's cgroup and a
    spare's, siblings under it; and the script both run."""
    found = own_memory_cgroup()
    if found is None or found[1] != 1:
        pytest.skip("the kernel's choice is proven here on cgroup v1 (v2 is not mounted on this machine)")
    parent = memory_cgroup(600 * MIB, "oomguard-oomorder")
    for name in ("worker", "spare"):
        (parent / name).mkdir()
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    yield parent, script
    for name in ("worker", "spare"):
        for _ in range(50):
            try:
                (parent / name).rmdir()
                break
            except OSError:
                time.sleep(0.1)


def oom_kills(cgroup: Path) -> int:
    return int((cgroup / "memory.oom_control").read_text().split("oom_kill ")[1].split()[0])


def race(job: tuple[Path, Path], spare_mib: int, worker_mib: int, worker_adj: int) -> tuple[int, bool]:
    """An idle spare (oom_score_adj 1000) holding ``spare_mib``, then a worker growing to ``worker_mib``
    (which fits the 600 MiB alone): (the worker's exit status, whether the spare was killed)."""
    parent, script = job
    before = {name: oom_kills(parent / name) for name in ("spare", "worker")}
    spare = subprocess.Popen([PY, str(script), str(parent / "spare" / "cgroup.procs"), "1000", str(spare_mib), "10",
                              "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert spare.stdout is not None and spare.stdout.readline() == "reached\n"
        worker = subprocess.run([PY, str(script), str(parent / "worker" / "cgroup.procs"), str(worker_adj),
                                 str(worker_mib), "4", "0.5"], capture_output=True, text=True, timeout=60)
        spare_killed = spare.poll() == -signal.SIGKILL
    finally:
        spare.kill()
        spare.wait()
    # v1 counts the kill in the victim's own cgroup only: the worker's counter is the worker's
    assert oom_kills(parent / "spare") - before["spare"] == int(spare_killed)
    assert oom_kills(parent / "worker") - before["worker"] == int(worker.returncode == -signal.SIGKILL)
    assert oom_kills(parent) == 0
    return worker.returncode, spare_killed


def test_the_kernel_takes_the_idle_spare_while_the_worker_exceeds_it_by_less_than_half_the_limit(
        job: tuple[Path, Path]) -> None:
    # at the limit the worker holds ~380 MiB, the spare 200: badness 380 + 600 * 500/1000 < 200 + 600
    assert race(job, 200, 450, 500) == (0, True)


def test_a_worker_at_oomguards_500_dies_beside_a_small_spare_and_at_a_direct_runs_score_lives(
        job: tuple[Path, Path]) -> None:
    """The kernel's badness is RSS plus oom_score_adj thousandths of the limit: a spare at 1000 is
    only half a limit ahead of a worker at 500, so a worker larger than the spare by more than half
    the limit is taken first though it fits alone. At the score a direct run has (0) it lives."""
    assert race(job, 60, 545, 500) == (-signal.SIGKILL, False)
    assert race(job, 60, 545, 0) == (0, True)


def test_at_the_score_oomguard_gives_a_worker_beside_a_spare_the_kernel_takes_the_spare(
        job: tuple[Path, Path]) -> None:
    score = worker_score(0, [60 * MIB], 600 * MIB)
    assert 0 < score < 500
    assert race(job, 60, 545, score) == (0, True)
    assert race(job, 200, 450, worker_score(0, [200 * MIB], 600 * MIB)) == (0, True)


# ----- the worker's score beside spares, on scripted figures


def test_a_workers_score_beside_spares_stays_below_the_bound_and_above_oomguard() -> None:
    assert worker_score(0, [], GIB) == 500  # no spare: the usual
    assert worker_score(200, [], GIB) == 700
    # half of 1000 * (376 + 752) / 1536 = 367.2
    assert worker_score(0, [376 * MIB, 376 * MIB], int(1.5 * GIB)) == 367
    # a timm-sized case: half of 1000 * 840 / 2300 = 182.6
    assert worker_score(0, [420 * MIB], 2300 * MIB) == 182
    assert worker_score(0, [GIB, GIB], 2 * GIB) == 500  # at most the usual
    assert worker_score(0, [10 * MIB], 24 * GIB) == 1  # never at oomguard's own score
    assert worker_score(900, [10 * MIB], 24 * GIB) == 901
    assert worker_score(700, [GIB], 2 * GIB) == 701
    assert worker_score(999, [], GIB) == 1000  # never past the kernel's maximum


def test_the_keeper_lowers_the_workers_score_while_a_spare_is_held_and_restores_it(tmp_path: Path) -> None:
    worker = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    log: list[tuple[str, dict[str, Any]]] = []
    spares = Spares(True, tmp_path / "run", tmp_path, None, lambda name, **data: log.append((name, data)),
                    memory=lambda: (20 * GIB, 24 * GIB), limit=Figures(SharedLimit(8 * GIB, 100 * MIB, "/job")))
    (tmp_path / "train.py").write_text("import json\n")
    own = int(Path("/proc/self/oom_score_adj").read_text())
    adj = Path(f"/proc/{worker.pid}/oom_score_adj")
    try:
        spares.prepare([PY, "train.py"], dict(os.environ))
        assert spares.pool and spares.pool[0].proc is not None
        expected = worker_score(own, [spares.pool[0].rss()], 8 * GIB + psutil.swap_memory().total)
        spares.observe(50 * MIB, trained=False, pids=[worker.pid])
        assert int(adj.read_text()) == expected and own < expected < own + 500  # a small spare: own + 1
        spares.discard()
        spares.observe(50 * MIB, trained=False, pids=[worker.pid])
        assert int(adj.read_text()) == min(1000, own + 500)  # none held: the usual
    finally:
        spares.discard()
        worker.kill()
        worker.wait()


def test_a_spare_killed_while_it_waits_is_dropped_at_the_next_tick_and_never_counts_against_the_worker(
        tmp_path: Path) -> None:
    """The kernel's OOM killer takes a spare (SIGKILL): the next tick drops it, ends the reserve for
    the run (a run that came that close will again), and starts nothing in its place."""
    log: list[tuple[str, dict[str, Any]]] = []
    spares = Spares(True, tmp_path / "run", tmp_path, None, lambda name, **data: log.append((name, data)),
                    memory=lambda: (20 * GIB, 24 * GIB), limit=Figures(None))
    (tmp_path / "train.py").write_text("import json\n")
    try:
        spares.prepare([PY, "train.py"], dict(os.environ))
        spare = spares.pool[0]
        assert spare.proc is not None
        os.killpg(spare.proc.pid, signal.SIGKILL)  # as the kernel would: the launcher and its interpreter
        spare.proc.wait(30)
        spares.tick()
        assert spare not in spares.pool and not spares.reserve
        names = [name for name, _ in log]
        assert names[names.index("spare_not_used"):][:2] == ["spare_not_used", "spare_reserve_off"]
        assert dict(log)["spare_not_used"]["why"] == "the spare was killed (SIGKILL) while it waited"
        assert spares.enabled  # the next attempt's spare still comes: only the reserve is off
    finally:
        spares.discard()


def test_on_v2_a_spares_kill_is_counted_in_its_own_cgroup_not_the_workers(tmp_path: Path) -> None:
    """v2 counts an OOM kill in the victim's ``memory.events`` and its ancestors' (the job's), never
    a sibling's: the worker's cgroup, beside the spare's, keeps its count (a fake tree as the kernel
    writes it after it took the spare)."""
    job = tmp_path / "job"
    for name, kills in (("", 1), ("oomguard-1-worker", 0), ("oomguard-1-spare-1", 1)):
        node = job / name
        node.mkdir(parents=True, exist_ok=True)
        (node / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {kills}\noom_group_kill 0\n")
        (node / "memory.max").write_text("max\n" if name else f"{GIB}\n")
        (node / "memory.current").write_text(f"{100 * MIB}\n")
        (node / "memory.stat").write_text("inactive_file 0\n")
    worker = MemoryCgroup(job / "oomguard-1-worker", 2)
    assert worker.oom_kills() == 0 and MemoryCgroup(job / "oomguard-1-spare-1", 2).oom_kills() == 1
    assert shared_limit(MemoryCgroup(job, 2)) == SharedLimit(GIB, 100 * MIB, str(job))
