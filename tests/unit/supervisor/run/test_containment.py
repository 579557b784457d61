"""Restart only onto free memory: the last attempt's leftover process (real) is named and ended,
and the wait ends once NVML (the fake pynvml at the edge) shows its memory freed."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
from support_gpu import GIB, UUIDS, FakeDevice, FakePynvml, monitor

from oomguard.supervisor.run.containment import AttemptProcesses, end, wait_for_gpus


class DyingHolder(FakePynvml):
    """A GPU on which a process's memory stays in use until the process is gone, and a moment more
    (the driver tears the context down after the exit)."""

    def __init__(self, pid: int, linger: float) -> None:
        super().__init__([FakeDevice(UUIDS[0], used=20 * GIB, procs=[(pid, 18 * GIB)])])
        self.pid, self.linger, self.gone_at = pid, linger, None  # type: ignore[var-annotated]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:  # type: ignore[type-arg]
        alive = psutil.pid_exists(self.pid) and psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        if not alive and self.gone_at is None:
            self.gone_at = time.monotonic()
        if self.gone_at is not None and time.monotonic() - self.gone_at >= self.linger:
            self.devices[0].procs, self.devices[0].used = [], 2 * GIB
        return super().nvmlDeviceGetComputeRunningProcesses(handle)


def test_leftover_is_named_ended_and_its_memory_waited_for() -> None:
    # A rank's data-loader child that outlived the attempt (here: a real process of the old tree).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen = AttemptProcesses()
    seen.add([psutil.Process(child.pid)])
    gpus = monitor(DyingHolder(child.pid, linger=0.6), pid_exists=lambda pid: True)
    baseline = {0: 2 * GIB}
    assert wait_for_gpus(gpus.read, seen.seen, baseline, timeout=0.6).holding.startswith(
        f"GPU 0: old attempt's pids {child.pid}")  # bounded: it does not wait for ever
    leftovers = seen.alive()
    assert [p.pid for p in leftovers] == [child.pid]
    named = end(leftovers)
    assert named[0].startswith(f"{child.pid} (") and "time.sleep(60)" in named[0]
    child.wait(timeout=5)  # psutil reaped it already: what matters is that it is gone
    assert not psutil.pid_exists(child.pid)
    done = wait_for_gpus(gpus.read, seen.seen, baseline, timeout=10)
    assert done.settled and done.holding == "" and 0.4 <= done.waited < 5


def test_a_reused_pid_is_never_ended() -> None:
    seen = AttemptProcesses({psutil.Process().pid: psutil.Process().create_time() - 100.0})
    assert seen.alive() == []  # same pid, another start time: not ours
