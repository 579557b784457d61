"""The spare interpreter (run/spare.py): real processes that become the worker, and what must not change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from support_spare import env_for, make_project, wait_until

from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.run.spare import (
    RESERVE_NICE,
    SPARE_NICE,
    Spare,
    Spares,
    Target,
    can_restore_priority,
    env_differences,
    heavy_imports,
    runs_as_file,
    target_of,
)

PY = sys.executable


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_project(tmp_path)


def events(log: list[tuple[str, dict[str, Any]]]) -> Callable[..., None]:
    return lambda name, /, **data: log.append((name, data))


def seen(output: bytes) -> dict[str, Any]:
    line = next(x for x in output.decode().splitlines() if x.startswith("SEEN "))
    return json.loads(line[5:])  # type: ignore[no-any-return]


# ----- the command and the script, read without running them


def test_only_a_plain_script_run_can_have_a_spare() -> None:
    assert target_of([PY, "-u", "-W", "ignore", "train.py", "--lr", "1"]) == Target(
        PY, ("-u", "-W", "ignore"), "train.py", ("--lr", "1"))
    assert isinstance(target_of(["torchrun", "--nproc-per-node", "2", "train.py"]), str)
    assert isinstance(target_of(["accelerate", "launch", "train.py"]), str)
    assert isinstance(target_of([PY, "-m", "torch.distributed.run", "train.py"]), str)
    assert isinstance(target_of([PY, "-c", "pass"]), str)
    assert isinstance(target_of([PY, "-I", "train.py"]), str)  # no script directory on sys.path
    assert isinstance(target_of(["bash", "train.sh"]), str)


def test_a_package_directory_or_zip_run_by_its_main_has_no_spare(tmp_path: Path) -> None:
    # ``python app`` and ``python app.zip`` run app's __main__.py: a spare's handover would read the path
    # itself as the script's source (it failed in sparestart.py), so only a plain file has a spare.
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("print('hi')\n")
    (tmp_path / "train.py").write_text("print('hi')\n")
    import zipfile

    with zipfile.ZipFile(tmp_path / "app.zip", "w") as archive:
        archive.write(tmp_path / "app" / "__main__.py", "__main__.py")
    assert runs_as_file(tmp_path / "train.py")
    assert not runs_as_file(tmp_path / "app") and not runs_as_file(tmp_path / "app.zip")
    assert not runs_as_file(tmp_path / "missing.py")


def test_imports_are_read_from_the_script_and_its_own_modules(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import torch\nfrom transformers import Trainer, TrainingArguments\n"
                                       "import helpers\nif True:\n    import lightning.pytorch as pl\n"
                                       "def maybe():\n    import deepspeed\n")  # not on every run
    (tmp_path / "helpers.py").write_text("from datasets import *\nimport numpy as np\n")
    assert heavy_imports(tmp_path / "train.py") == ["torch", "transformers:Trainer,TrainingArguments",
                                                    "lightning.pytorch", "datasets", "numpy", "torch._dynamo"]
    (tmp_path / "infer.py").write_text("import torch\nprint(torch.zeros(1))\n")  # no optimizer: no dynamo
    assert heavy_imports(tmp_path / "infer.py") == ["torch"]


def test_only_per_attempt_variables_may_differ() -> None:
    started = {"PATH": "/bin", "OMP_NUM_THREADS": "4", "PYTORCH_CUDA_ALLOC_CONF": ""}
    wanted = {"PATH": "/bin", "OMP_NUM_THREADS": "4", "OOMGUARD_MICRO_BATCH": "8",
              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert env_differences(started, wanted) == []
    assert env_differences(started, {**wanted, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}) == [
        "HF_HUB_OFFLINE", "OMP_NUM_THREADS"]


# ----- real spares


def take(project: Path, start_env: dict[str, str], argv: list[str], env: dict[str, str],
         log: list[tuple[str, dict[str, Any]]]) -> Spare | None:
    spares = Spares(True, project / "run", project, None, events(log))
    spares.prepare([PY, "sub/seen.py", "first"], start_env)
    assert spares.spare is not None
    return spares.take(argv, env, lambda: False)


def test_the_spare_becomes_the_worker_as_a_direct_run_would_start(project: Path) -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    env = env_for(project, X_PER_ATTEMPT="2", OOMGUARD_ATTEMPT="2", PYTORCH_ALLOC_CONF="expandable_segments:True")
    spare = take(project, env_for(project, X_PER_ATTEMPT="2", OOMGUARD_ATTEMPT="1"),
                 [PY, "sub/seen.py", "--mb", "4"], env, log)
    assert spare is not None, log
    proc = spare.hand_over()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    via_spare = seen(out)
    direct = subprocess.run([PY, "sub/seen.py", "--mb", "4"], cwd=project, env=env, capture_output=True,
                            stdin=subprocess.DEVNULL, check=True, timeout=120)
    expected = seen(direct.stdout)
    assert via_spare["prewarmed"] and not expected["prewarmed"]
    for key in ("argv", "name", "path0", "cwd", "x", "attempt", "stdin", "file"):
        assert via_spare[key] == expected[key], key
    assert via_spare["argv"] == ["sub/seen.py", "--mb", "4"] and via_spare["name"] == "__main__"
    assert [name for name, _ in log] == ["spare_started", "spare_used"] and spare.lost is None
    spare.containment.remove()


def test_a_spare_that_exited_before_its_handover_says_how(project: Path) -> None:
    """The kernel's OOM killer takes a spare first, also between its ready record and the handover (while
    the last attempt's leftovers settle): the script never runs, so what ends the attempt is the spare's
    (decide/classify.py), not the batch's."""
    log: list[tuple[str, dict[str, Any]]] = []
    spare = take(project, env_for(project), [PY, "sub/seen.py"], env_for(project), log)
    assert spare is not None and spare.proc is not None and spare.pid is not None, log
    os.kill(spare.pid, signal.SIGKILL)
    wait_until(lambda: spare.proc is not None and spare.proc.poll() is not None)  # its launcher ends as it did
    proc = spare.hand_over()
    assert proc.wait(30) == -signal.SIGKILL and b"SEEN" not in (proc.stdout.read() if proc.stdout else b"")
    assert spare.lost == "it had exited before the handover, killed by SIGKILL"
    spare.containment.remove()


def test_a_changed_import_time_variable_means_a_cold_start(project: Path) -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    spare = take(project, env_for(project), [PY, "sub/seen.py"], env_for(project, OMP_NUM_THREADS="1"), log)
    assert spare is None
    name, data = log[-1]
    assert name == "spare_not_used" and "OMP_NUM_THREADS" in data["why"]


def test_a_different_script_means_a_cold_start(project: Path) -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    (project / "sub" / "other.py").write_text("pass\n")
    assert take(project, env_for(project), [PY, "sub/other.py"], env_for(project), log) is None
    assert log[-1][0] == "spare_not_used"


def test_a_spare_imports_torch_without_initializing_cuda_and_the_allocator_setting_still_applies(
        tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "t.py"
    script.write_text(
        "import sys\nwas_loaded = 'torch' in sys.modules\nimport torch\n"
        "print('CUDA', was_loaded, torch.cuda.is_initialized(), flush=True)\n"
        # After the handover: the device-generic settings are parsed on first use, from the new environment.
        "print('ALLOC', torch._C._accelerator_getAllocatorSettings(), flush=True)\n")
    log: list[tuple[str, dict[str, Any]]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OOMGUARD_", "PYTORCH_"))}
    spares = Spares(True, tmp_path / "run", tmp_path, None, events(log))
    spares.prepare([PY, "t.py"], env)
    spare = spares.take([PY, "t.py"], {**env, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}, lambda: False)
    assert spare is not None, log
    assert log[-1][1]["imported"] == ["torch"]  # its ready record: imported, and torch.cuda not initialized
    out, _ = spare.hand_over().communicate(timeout=300)
    assert "CUDA True False" in out.decode()  # torch was imported by the spare; CUDA untouched
    assert "ALLOC expandable_segments:True" in out.decode()
    spare.containment.remove()


# ----- under the supervisor


def test_once_host_memory_runs_out_no_more_spares(project: Path) -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    spares = Spares(True, project / "run", project, None, events(log))
    spares.prepare([PY, "sub/seen.py"], env_for(project))
    assert spares.spare is not None and spares.spare.proc is not None
    launcher = spares.spare.proc
    spares.after_failure(FailureKind.CUDA_OOM, None)  # GPU memory: the spare holds none
    spares.after_failure(FailureKind.HOST_OOM, None)  # the allocator's own failure (RLIMIT_AS): the worker's alone
    assert spares.spare is not None
    spares.after_failure(FailureKind.HOST_OOM, signal.SIGKILL)  # the kernel's OOM killer
    assert spares.spare is None and launcher.poll() is not None and log[-1][0] == "spare_off"
    spares.prepare([PY, "sub/seen.py"], env_for(project))
    assert spares.spare is None


# ----- the reserve (decide/policy.py)


class HostMemory:
    """What ``Spares`` reads of the host's memory: settable by the test."""

    def __init__(self, available: int, total: int = 64 << 30) -> None:
        self.available, self.total = available, total

    def __call__(self) -> tuple[int, int]:
        return self.available, self.total


def test_a_launchers_command_is_told_nothing_of_spares_it_never_had(project: Path) -> None:
    """torchrun starts its own workers: no spare is started, so a kernel OOM kill says nothing of one."""
    log: list[tuple[str, dict[str, Any]]] = []
    spares = Spares(True, project / "run", project, None, events(log))
    spares.prepare(["torchrun", "--standalone", "--nproc_per_node=2", "sub/seen.py"], env_for(project))
    assert spares.spare is None
    spares.after_failure(FailureKind.HOST_OOM, signal.SIGKILL)
    assert [name for name, _ in log if name == "spare_off"] == [] and not spares.enabled


def pool_of(project: Path, memory: HostMemory, log: list[tuple[str, dict[str, Any]]]) -> Spares:
    spares = Spares(True, project / "run", project, None, events(log), memory)
    spares.prepare([PY, "sub/seen.py"], env_for(project))
    return spares


def ticked_until(spares: Spares, count: int) -> None:
    """Tick as the loop does until ``count`` spares have imported."""
    def done() -> bool:
        spares.tick()
        return sum(s.is_ready() for s in spares.pool) >= count
    wait_until(done)


def interpreter_nice(spare: Spare) -> int:
    """The nice value of the spare's interpreter (the launcher's child)."""
    assert spare.proc is not None
    wait_until(lambda: bool(psutil.Process(spare.proc.pid).children()))  # type: ignore[union-attr]
    return int(psutil.Process(spare.proc.pid).children()[0].nice())


def test_the_reserve_waits_behind_the_first_spare_and_there_are_never_more_than_two(project: Path) -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    spares = pool_of(project, HostMemory(48 << 30), log)
    try:
        assert len(spares.pool) == 1  # the next attempt's; the loop's ticks add the reserve
        spares.tick()
        assert len(spares.pool) == 2 and [d["reserve"] for n, d in log if n == "spare_started"] == [False, True]
        first, reserve = spares.pool
        if not first.is_ready():  # behind a spare still importing, at the lowest priority
            assert reserve.nice == RESERVE_NICE
        ticked_until(spares, 2)
        for _ in range(5):
            spares.tick()
        assert spares.pool == [first, reserve] and reserve.nice == SPARE_NICE  # raised once the first imported
        # 19 is the lowest priority the kernel gives
        assert interpreter_nice(reserve) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + SPARE_NICE)
        assert first.size() > 0  # an interpreter's resident memory, measured once it has imported
        taken = spares.take([PY, "sub/seen.py"], env_for(project), lambda: False)
        assert taken is first and spares.pool == [reserve]  # the reserve stays for the attempt after
        assert log[-1][0] == "spare_used" and log[-1][1]["ready"] is True
        taken.discard()
        spares.tick()  # the pool refills behind the reserve
        assert len(spares.pool) == 2 and spares.pool[0] is reserve
    finally:
        spares.discard()


def test_a_raise_that_came_before_the_reserves_own_start_nice_is_made_again_once_it_has_imported(
        project: Path) -> None:
    """The race the test above met one run in four under load: the first spare imported while the
    reserve's interpreter was still starting, so the raise to SPARE_NICE came before the interpreter's
    own ``os.nice(RESERVE_NICE)``, which then left it at 19; it imported at once and was ready, so no
    tick raised it again. Here that order is set up by hand: a raise made before the ready record."""
    if not can_restore_priority():
        pytest.skip("raising a priority back needs root or RLIMIT_NICE")
    spares = pool_of(project, HostMemory(48 << 30), [])
    try:
        ticked_until(spares, 1)
        spares.tick()
        ticked_until(spares, 2)
        reserve = spares.pool[1]
        reserve.start_nice, reserve.nice, reserve.settled = RESERVE_NICE, SPARE_NICE, False
        interpreter_nice(reserve)  # its interpreter is up
        os.setpriority(os.PRIO_PROCESS, psutil.Process(reserve.proc.pid).children()[0].pid, 19)  # type: ignore[union-attr]
        spares.tick()
        assert interpreter_nice(reserve) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + SPARE_NICE)
        assert reserve.settled
    finally:
        spares.discard()


def test_no_reserve_on_a_host_short_of_memory_and_it_is_dropped_when_memory_runs_short(project: Path) -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    memory = HostMemory(8 << 30)  # 8 GiB available of 64: under the quarter a reserve must leave
    spares = pool_of(project, memory, log)
    try:
        ticked_until(spares, 1)
        spares.tick()
        assert len(spares.pool) == 1  # the next attempt's spare keeps its rules; no reserve
        size = spares.pool[0].size()  # what the reserve will hold: the measured spare
        memory.available = (16 << 30) + size // 2  # a quarter of 64 GiB, and not the reserve on top
        spares.tick()
        assert len(spares.pool) == 1
        memory.available = (16 << 30) + size
        ticked_until(spares, 2)
        reserve = spares.pool[1]
        assert reserve.proc is not None
        memory.available = 10 << 30  # the worker grew
        spares.tick()
        assert spares.pool == [spares.pool[0]] and reserve.proc.poll() is not None  # killed, with its group
        assert log[-1][0] == "spare_reserve_off" and not spares.reserve
        memory.available = 48 << 30
        for _ in range(5):
            spares.tick()
        assert len(spares.pool) == 1  # not again in this run
    finally:
        spares.discard()


def test_a_spare_the_kernel_killed_ends_the_reserve_and_the_next_one_is_taken(project: Path) -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    spares = pool_of(project, HostMemory(48 << 30), log)
    try:
        ticked_until(spares, 2)
        first, reserve = spares.pool
        assert first.proc is not None
        interpreter = json.loads(first.ready_file.read_text())["pid"]
        os.kill(interpreter, signal.SIGKILL)  # as the OOM killer takes a spare (oom_score_adj 1000) first
        first.proc.wait(30)
        taken = spares.take([PY, "sub/seen.py"], env_for(project), lambda: False)
        assert taken is reserve and not spares.reserve
        assert [n for n, _ in log][-3:] == ["spare_not_used", "spare_reserve_off", "spare_used"]
        taken.discard()
    finally:
        spares.discard()


def test_the_kernel_killing_the_worker_ends_every_spare(project: Path) -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    spares = pool_of(project, HostMemory(48 << 30), log)
    ticked_until(spares, 2)
    launchers = [s.proc for s in spares.pool]
    spares.after_failure(FailureKind.HOST_OOM, signal.SIGKILL)
    assert spares.pool == [] and all(p is not None and p.poll() is not None for p in launchers)
    spares.tick()
    spares.prepare([PY, "sub/seen.py"], env_for(project))
    assert spares.pool == []


def test_a_spare_still_importing_at_its_start_priority_is_not_reniced_each_tick(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its interpreter sets its own start nice: a tick renices (a scan of every process for its
    children) only one whose priority changed since, as a reserve's raised behind a spare."""
    reniced: list[int] = []
    monkeypatch.setattr(Spare, "renice", lambda self, nice: reniced.append(nice))
    monkeypatch.setattr(Spare, "is_ready", lambda self: False)  # importing, whatever the machine's speed
    spares = pool_of(project, HostMemory(1 << 30), [])  # no room for a reserve: one spare
    try:
        for _ in range(3):
            spares.tick()
        assert len(spares.pool) == 1 and reniced == []
        spares.pool[0].nice = 0  # raised since it started (the loop's renice, patched out here)
        spares.tick()
        assert reniced == [0]
    finally:
        spares.discard()
