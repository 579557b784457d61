"""The sampler against the real machine: psutil on real processes, a real memory cgroup, real PSI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from support_gpu import GIB, UUIDS, FakeDevice, FakePynvml, monitor

from oomguard.supervisor.observe.cgroup import MemoryCgroup, locate_cgroup
from oomguard.supervisor.observe.gpu import GpuMonitor, GpuReading
from oomguard.supervisor.observe.sampler import (
    AttemptPeak,
    CgroupMemory,
    MemoryAction,
    MemorySample,
    Pressure,
    Sampler,
    Thresholds,
    evaluate,
    fold_peak,
    parse_fraction,
    process_rank,
    read_pressure,
    tree_memory,
)
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.sizing.memmodel import SizeTuner
from oomguard.web.metrics import make_registry

MIB = 1024**2

# A parent holding 150 MiB that forks a child holding 100 MiB, then both wait to be killed.
HOLDER = """
import os, sys, time
block = bytearray({parent_mib} * 1024 * 1024)
for i in range(0, len(block), 4096): block[i] = 1
if os.fork() == 0:
    child = bytearray({child_mib} * 1024 * 1024)
    for i in range(0, len(child), 4096): child[i] = 1
    print("child", flush=True)
    time.sleep(60)
    os._exit(0)
print("parent", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder() -> Iterator[subprocess.Popen[str]]:
    code = HOLDER.format(parent_mib=150, child_mib=100)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    seen = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
    assert seen == {"parent", "child"}
    yield proc
    os.killpg(proc.pid, 9)
    proc.wait()


def no_gpu_sampler() -> Sampler:
    return Sampler(gpu=GpuMonitor(visible_devices=""))


def test_tree_rss_counts_children(holder: subprocess.Popen[str]) -> None:
    tree = tree_memory(holder.pid)
    assert tree is not None and len(tree.pids) == 2 and holder.pid in tree.pids
    assert tree.rss_bytes >= 250 * MIB


def test_sample_of_a_real_worker(holder: subprocess.Popen[str]) -> None:
    sampler = Sampler()
    sample = sampler.sample(holder.pid)
    sampler.close()
    assert sample.worker_pid == holder.pid and (sample.worker_rss_bytes or 0) >= 250 * MIB
    assert 0 < sample.host_available_bytes <= sample.host_total_bytes
    assert sample.monotonic > 0 and abs(sample.wall - time.time()) < 5
    if not sample.gpus:
        assert sample.gpu_unavailable and "\n" not in sample.gpu_unavailable
    row = sample.as_row()
    assert row["worker_rss_bytes"] == sample.worker_rss_bytes and "psi_some_avg10" in row


def test_gone_worker_has_no_rss() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    sample = no_gpu_sampler().sample(proc.pid)
    assert sample.worker_rss_bytes is None and sample.worker_pids == ()


def test_no_worker_samples_the_host() -> None:
    sample = no_gpu_sampler().sample(None)
    assert sample.worker_rss_bytes is None and sample.host_total_bytes > 0


# --- cgroups ----------------------------------------------------------------------------------


@pytest.fixture
def child_cgroup() -> Iterator[MemoryCgroup]:
    own = MemoryCgroup.for_pid("self")
    if own is None:
        pytest.skip("no memory cgroup readable on this machine")
    path = own.path / f"oomguard-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        limit_file = "memory.limit_in_bytes" if own.version == 1 else "memory.max"
        (path / limit_file).write_text(str(512 * MIB))
    except OSError as exc:
        pytest.skip(f"cannot create a child memory cgroup under {own.path}: {exc}")
    yield MemoryCgroup(path, own.version)
    for _ in range(50):  # rmdir fails while the killed process is still being reaped
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.05)


@pytest.mark.cgroup
def test_real_child_cgroup_limit_and_usage(child_cgroup: MemoryCgroup) -> None:
    before = child_cgroup.read()
    assert before.limit_bytes == 512 * MIB and before.oom_kills in (0, None)
    # Start a fresh holder inside the cgroup: memory is charged where it is first touched.
    code = HOLDER.format(parent_mib=120, child_mib=60)
    move_in = f"echo $$ > {child_cgroup.path}/cgroup.procs && exec {sys.executable} -c '{code}'"
    proc = subprocess.Popen(["sh", "-c", move_in], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        proc.stdout.readline()
        after = child_cgroup.read()
        assert after.usage_bytes >= 180 * MIB and 150 * MIB <= after.working_set_bytes <= after.usage_bytes
        found = MemoryCgroup.for_pid(proc.pid)
        assert found is not None and found.path == child_cgroup.path
        sample = no_gpu_sampler().sample(proc.pid)  # the sampler finds the worker's cgroup itself
        assert sample.cgroup is not None and sample.cgroup.limit_bytes == 512 * MIB
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_v2_reader_over_a_directory(tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    cg = parent / "worker"
    cg.mkdir(parents=True)
    (parent / "memory.max").write_text("1073741824\n")
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text(f"{300 * MIB}\n")
    (cg / "memory.stat").write_text(f"anon {200 * MIB}\nfile {100 * MIB}\ninactive_file {80 * MIB}\n")
    (cg / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    got = MemoryCgroup(cg, 2).read()
    assert (got.usage_bytes, got.working_set_bytes) == (300 * MIB, 220 * MIB)
    assert got.limit_bytes == 1024 * MIB  # the parent's limit binds the unlimited child
    assert got.oom_kills == 1 and got.version == 2
    assert got.limit_working_set_bytes is None and got.counted_bytes == 220 * MIB  # the parent's usage: unreadable
    # What the parent's limit counts: everything in the parent (oomguard beside its worker), not the worker alone.
    (parent / "memory.current").write_text(f"{400 * MIB}\n")
    (parent / "memory.stat").write_text(f"anon {300 * MIB}\ninactive_file {90 * MIB}\n")
    got = MemoryCgroup(cg, 2).read()
    assert got.limit_working_set_bytes == 310 * MIB and got.counted_bytes == 310 * MIB
    assert got.working_set_bytes == 220 * MIB


def test_v1_reader_over_a_directory(tmp_path: Path) -> None:
    (tmp_path / "memory.usage_in_bytes").write_text(f"{100 * MIB}\n")
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory.stat").write_text(f"cache 0\ntotal_inactive_file {10 * MIB}\n")
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    got = MemoryCgroup(tmp_path, 1).read()
    assert got.limit_bytes is None and got.working_set_bytes == 90 * MIB and got.oom_kills == 2


def test_real_own_cgroup_is_found() -> None:
    own = MemoryCgroup.for_pid("self")
    if own is None:
        pytest.skip("no memory cgroup on this machine")
    assert own.read().usage_bytes > 0


def test_locate_cgroup_parses_hybrid_and_unified(tmp_path: Path) -> None:
    v1 = tmp_path / "memory" / "jobs" / "a"
    v1.mkdir(parents=True)
    (v1 / "memory.usage_in_bytes").write_text("1\n")
    hybrid_mounts = (
        f"35 31 0:32 / {tmp_path}/memory rw - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {tmp_path}/unified rw - cgroup2 cgroup2 rw\n"
    )
    found = locate_cgroup("4:memory:/jobs/a\n0::/\n", hybrid_mounts)
    assert found is not None and found.path == v1 and found.version == 1

    v2 = tmp_path / "v2" / "user.slice" / "job"
    v2.mkdir(parents=True)
    (v2 / "memory.current").write_text("1\n")
    unified = f"30 23 0:26 / {tmp_path}/v2 rw - cgroup2 cgroup2 rw\n"
    found = locate_cgroup("0::/user.slice/job\n", unified)
    assert found is not None and found.path == v2 and found.version == 2
    # Inside a cgroup namespace the mount root is the container's cgroup.
    ns_job = tmp_path / "ns" / "job"
    ns_job.mkdir(parents=True)
    (ns_job / "memory.current").write_text("1\n")
    ns = f"30 23 0:26 /user.slice {tmp_path}/ns rw - cgroup2 cgroup2 rw\n"
    found = locate_cgroup("0::/user.slice/job\n", ns)
    assert found is not None and found.path == ns_job
    assert locate_cgroup("0::/nowhere\n", unified) is None


# --- PSI and peaks ----------------------------------------------------------------------------


def test_psi_real_and_parsed(tmp_path: Path) -> None:
    real = Path("/proc/pressure/memory")
    if real.exists():
        assert read_pressure(real) is not None
    fake = tmp_path / "memory"
    fake.write_text(
        "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=4.25 avg60=1.00 avg300=0.00 total=45\n"
    )
    pressure = read_pressure(fake)
    assert pressure is not None and (pressure.some_avg10, pressure.full_avg10) == (12.5, 4.25)
    assert read_pressure(tmp_path / "absent") is None


def sample(rss: int | None, t: float = 0.0) -> MemorySample:
    return MemorySample(t, 1000.0 + t, 1, rss, (1,), 10 * 1024 * MIB, 5 * 1024 * MIB, None, None)


def test_fold_peak_keeps_the_highest() -> None:
    peak: AttemptPeak | None = None
    for t, rss in enumerate([100, 300, 200, None]):
        peak = fold_peak(peak, sample(rss, float(t)))
    assert peak is not None and peak.worker_rss_bytes == 300 and peak.at_wall == 1001.0
    assert peak.worker_gpu_bytes is None


def test_sampling_is_cheap(holder: subprocess.Popen[str]) -> None:
    sampler = no_gpu_sampler()
    start = time.process_time()
    for _ in range(50):
        sampler.sample(holder.pid)
    per_sample = (time.process_time() - start) / 50
    assert per_sample < 0.01  # 1 % of a core at 1 Hz


# --- merged from tests/test_gpu_ranks.py --------------------------------------------------------------------
# Memory per GPU and per rank: the fake pynvml at the NVML edge, real rank processes (RANK in their
# environment, as torchrun sets it), the real sample, thresholds, memory model and /metrics.


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


# --- merged from tests/test_thresholds.py -------------------------------------------------------------------
# The soft/hard thresholds: a pure function over samples, then the same function on a real worker.




def gpu(used: int, total: int = 80 * GIB) -> GpuReading:
    return GpuReading(0, 0, "GPU-x", "H100", total, used, total - used, 90, used, (1,))


def sample_thresholds(
    rss: int | None = GIB,
    available: int = 20 * GIB,
    gpus: tuple[GpuReading, ...] = (),
    cgroup: CgroupMemory | None = None,
    psi: float = 0.0,
) -> MemorySample:
    return MemorySample(0.0, 0.0, 1, rss, (1, 2), 32 * GIB, available, cgroup, Pressure(psi, 0.0), gpus)


def test_quiet_sample_needs_nothing() -> None:
    assert evaluate(sample_thresholds(gpus=(gpu(40 * GIB),)), Thresholds(), False).action is MemoryAction.NONE


def test_gpu_at_soft_threshold_requests_checkpoint() -> None:
    verdict = evaluate(sample_thresholds(gpus=(gpu(77 * GIB),)), Thresholds(soft_fraction=0.95), False)
    assert verdict.action is MemoryAction.CHECKPOINT and verdict.reason == "soft_threshold"
    assert "GPU 0" in verdict.evidence and "--soft-threshold 95%" in verdict.evidence


def test_pending_request_is_not_repeated() -> None:
    verdict = evaluate(sample_thresholds(gpus=(gpu(77 * GIB),)), Thresholds(), True)
    assert verdict.action is MemoryAction.NONE and "pending" in verdict.reason


def test_memory_limit_soft_then_hard() -> None:
    limits = Thresholds(soft_fraction=0.9, memory_limit_bytes=10 * GIB)
    assert evaluate(sample_thresholds(rss=8 * GIB), limits, False).action is MemoryAction.NONE
    assert evaluate(sample_thresholds(rss=9 * GIB), limits, False).action is MemoryAction.CHECKPOINT
    hard = evaluate(sample_thresholds(rss=10 * GIB), limits, True)  # hard wins even with a request pending
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
    assert evaluate(sample_thresholds(cgroup=cg), Thresholds(), False).action is MemoryAction.NONE
    tight = CgroupMemory("/sys/fs/cgroup/job", 2, 16 * GIB, 15 * GIB + 512 * MIB, 16 * GIB, 0)
    verdict = evaluate(sample_thresholds(cgroup=tight), Thresholds(), False)
    assert verdict.action is MemoryAction.CHECKPOINT and "cgroup" in verdict.evidence


def test_host_nearly_full_requests_checkpoint() -> None:
    verdict = evaluate(sample_thresholds(available=GIB), Thresholds(), False)
    assert verdict.action is MemoryAction.CHECKPOINT and "host memory" in verdict.evidence


def test_psi_trigger_only_when_configured() -> None:
    assert evaluate(sample_thresholds(psi=60.0), Thresholds(), False).action is MemoryAction.NONE
    verdict = evaluate(sample_thresholds(psi=60.0), Thresholds(psi_some_avg10=25.0), False)
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
