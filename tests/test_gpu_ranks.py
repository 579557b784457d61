"""Memory per GPU and per rank: the fake pynvml at the NVML edge, real rank processes (RANK in their
environment, as torchrun sets it), the real sample, thresholds, memory model and /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from test_gpu import GIB, UUIDS, FakeDevice, FakePynvml, monitor

from oomguard.supervisor.observe.sampler import MemoryAction, MemorySample, Thresholds, evaluate, process_rank
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.sizing.tuning import SizeTuner
from oomguard.web.metrics import make_registry


@pytest.fixture
def ranks() -> Iterator[list[int]]:
    """Two real processes that are ranks 0 and 1."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    # Popen returns once the child execs, before the kernel has set up its new environment:
    # /proc/PID/environ can read empty for a moment. A rank reads as one once its environment is there.
    deadline = time.monotonic() + 30
    while any(process_rank(p.pid) is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def test_every_gpu_and_every_rank_is_read_and_the_tightest_gpu_decides(ranks: list[int], tmp_path: Path) -> None:
    rank0, rank1 = ranks
    fake = FakePynvml([FakeDevice(UUIDS[0], total=80 * GIB, used=60 * GIB, procs=[(rank0, 58 * GIB)]),
                       FakeDevice(UUIDS[1], name="NVIDIA A100 40GB", total=40 * GIB, used=39 * GIB,
                                  procs=[(rank1, 37 * GIB), (4242, GIB)])])
    snap = monitor(fake, pid_exists=lambda pid: True).read([rank0, rank1])
    assert [d.worker_processes for d in snap.devices] == [((rank0, 58 * GIB),), ((rank1, 37 * GIB),)]
    sample = MemorySample(time.monotonic(), time.time(), rank0, GIB, (rank0, rank1), 64 * GIB, 32 * GIB, None, None,
                          snap.devices)
    row = sample.as_row()
    assert [(d["cuda_index"], d["ranks"]) for d in row["gpus"]] == [(0, {"0": 58 * GIB}), (1, {"1": 37 * GIB})]
    # 39/40 on GPU 1 is past a 95 % soft threshold although GPU 0 (60/80) is not: GPU 1 decides.
    verdict = evaluate(sample, Thresholds(soft_fraction=0.95), False)
    assert verdict.action is MemoryAction.CHECKPOINT and "GPU 1 (NVIDIA A100 40GB)" in verdict.evidence
    # The memory model fits every rank under the smallest device.
    assert SizeTuner(16, 1, 0.05).capacity(sample) == 40 * GIB
    # /metrics shows every GPU and every rank on it.
    (tmp_path / "run").mkdir()
    journal = Journal(tmp_path / "run")
    journal.record_sample(1, row, time.time(), GIB, sample.worker_gpu_bytes, None, None)
    text = generate_latest(make_registry(lambda: journal)).decode()
    assert f'oomguard_gpu_rank_memory_bytes{{device="1",rank="1"}} {float(37 * GIB):.10e}' in text
    assert f'oomguard_gpu_rank_memory_bytes{{device="0",rank="0"}} {float(58 * GIB):.10e}' in text
    assert 'oomguard_gpu_memory_used_bytes{device="0"}' in text and 'oomguard_gpu_memory_used_bytes{device="1"}' in text
