"""The soft/hard thresholds: a pure function over samples, then the same function on a real worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomguard.supervisor.observe.gpu import GpuMonitor, GpuReading
from oomguard.supervisor.observe.sampler import (
    CgroupMemory,
    MemoryAction,
    MemorySample,
    Pressure,
    Sampler,
    Thresholds,
    evaluate,
    parse_fraction,
)

GIB = 1024**3
MIB = 1024**2


def gpu(used: int, total: int = 80 * GIB) -> GpuReading:
    return GpuReading(0, 0, "GPU-x", "H100", total, used, total - used, 90, used, (1,))


def sample(
    rss: int | None = GIB,
    available: int = 20 * GIB,
    gpus: tuple[GpuReading, ...] = (),
    cgroup: CgroupMemory | None = None,
    psi: float = 0.0,
) -> MemorySample:
    return MemorySample(0.0, 0.0, 1, rss, (1, 2), 32 * GIB, available, cgroup, Pressure(psi, 0.0), gpus)


def test_quiet_sample_needs_nothing() -> None:
    assert evaluate(sample(gpus=(gpu(40 * GIB),)), Thresholds(), False).action is MemoryAction.NONE


def test_gpu_at_soft_threshold_requests_checkpoint() -> None:
    verdict = evaluate(sample(gpus=(gpu(77 * GIB),)), Thresholds(soft_fraction=0.95), False)
    assert verdict.action is MemoryAction.CHECKPOINT and verdict.reason == "soft_threshold"
    assert "GPU 0" in verdict.evidence and "--soft-threshold 95%" in verdict.evidence


def test_pending_request_is_not_repeated() -> None:
    verdict = evaluate(sample(gpus=(gpu(77 * GIB),)), Thresholds(), True)
    assert verdict.action is MemoryAction.NONE and "pending" in verdict.reason


def test_memory_limit_soft_then_hard() -> None:
    limits = Thresholds(soft_fraction=0.9, memory_limit_bytes=10 * GIB)
    assert evaluate(sample(rss=8 * GIB), limits, False).action is MemoryAction.NONE
    assert evaluate(sample(rss=9 * GIB), limits, False).action is MemoryAction.CHECKPOINT
    hard = evaluate(sample(rss=10 * GIB), limits, True)  # hard wins even with a request pending
    assert hard.action is MemoryAction.STOP and hard.reason == "memory_limit" and "--memory-limit" in hard.evidence


def test_cgroup_working_set_counts_not_cache() -> None:
    cg = CgroupMemory(
        "/sys/fs/cgroup/job",
        2,
        usage_bytes=15 * GIB,
        working_set_bytes=5 * GIB,
        limit_bytes=16 * GIB,
        oom_kills=0,
    )
    assert evaluate(sample(cgroup=cg), Thresholds(), False).action is MemoryAction.NONE
    tight = CgroupMemory("/sys/fs/cgroup/job", 2, 16 * GIB, 15 * GIB + 512 * MIB, 16 * GIB, 0)
    verdict = evaluate(sample(cgroup=tight), Thresholds(), False)
    assert verdict.action is MemoryAction.CHECKPOINT and "cgroup" in verdict.evidence


def test_host_nearly_full_requests_checkpoint() -> None:
    verdict = evaluate(sample(available=GIB), Thresholds(), False)
    assert verdict.action is MemoryAction.CHECKPOINT and "host memory" in verdict.evidence


def test_psi_trigger_only_when_configured() -> None:
    assert evaluate(sample(psi=60.0), Thresholds(), False).action is MemoryAction.NONE
    verdict = evaluate(sample(psi=60.0), Thresholds(psi_some_avg10=25.0), False)
    assert verdict.action is MemoryAction.CHECKPOINT and verdict.reason == "memory_pressure"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"soft_fraction": 95.0}, "--soft-threshold"),
        ({"soft_fraction": 0.0}, "--soft-threshold"),
        ({"psi_some_avg10": 150.0}, "--psi-threshold"),
        ({"memory_limit_bytes": 0}, "--memory-limit"),
    ],
)
def test_bad_thresholds_name_the_option(kwargs: dict[str, float], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Thresholds(**kwargs)  # type: ignore[arg-type]


def test_parse_fraction() -> None:
    assert parse_fraction("95%") == pytest.approx(0.95) and parse_fraction("0.9") == 0.9
    with pytest.raises(ValueError, match="--soft-threshold"):
        parse_fraction("lots")
    with pytest.raises(ValueError, match="write 0.95"):
        Thresholds(soft_fraction=parse_fraction("95"))


# A worker that grows 20 MiB every 50 ms and notes SIGUSR1 (the checkpoint request) in a file.
GROWER = """
import signal, sys, time
def on_request(signum, frame):
    open(sys.argv[1], "w").write(str(sum(len(b) for b in blocks)))
signal.signal(signal.SIGUSR1, on_request)
blocks = []
while True:
    blocks.append(bytearray(20 * 1024 * 1024))
    for i in range(0, len(blocks[-1]), 4096): blocks[-1][i] = 1
    time.sleep(0.05)
    if len(blocks) > 100: time.sleep(60)
"""


def test_real_worker_gets_checkpoint_request_before_the_hard_stop(tmp_path: Path) -> None:
    marker = tmp_path / "checkpoint-requested"
    worker = subprocess.Popen([sys.executable, "-c", GROWER, str(marker)])
    limits = Thresholds(soft_fraction=0.6, memory_limit_bytes=400 * MIB)
    sampler = Sampler(gpu=GpuMonitor(visible_devices=""))
    actions: list[MemoryAction] = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and MemoryAction.STOP not in actions:
            verdict = evaluate(
                sampler.sample(worker.pid), limits, checkpoint_pending=MemoryAction.CHECKPOINT in actions
            )
            if verdict.action is MemoryAction.CHECKPOINT:
                os.kill(worker.pid, signal.SIGUSR1)
            actions.append(verdict.action)
            time.sleep(0.05)
    finally:
        worker.kill()
        worker.wait()
    assert MemoryAction.CHECKPOINT in actions and actions[-1] is MemoryAction.STOP
    assert actions.index(MemoryAction.CHECKPOINT) < actions.index(MemoryAction.STOP)
    assert actions.count(MemoryAction.CHECKPOINT) == 1  # once pending, not repeated
    held = int(marker.read_text())  # the worker saw the request while still under the hard limit
    assert 0.5 * 400 * MIB <= held < 400 * MIB
