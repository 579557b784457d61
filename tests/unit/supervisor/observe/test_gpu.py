"""The NVML seam: a fake ``pynvml`` module (real error classes) behind the real ``PyNvml`` wrapper."""

from __future__ import annotations

import os

import pynvml
import pytest
from support_gpu import GIB, UUIDS, FakeDevice, FakePynvml, monitor

from oomguard.supervisor.observe.gpu import GpuMonitor, parse_visible_devices


def test_reads_every_device_and_the_worker_share() -> None:
    me = os.getpid()
    fake = FakePynvml(
        [
            FakeDevice(UUIDS[0], used=30 * GIB, procs=[(me, 20 * GIB), (1, 5 * GIB)]),
            FakeDevice(UUIDS[1], used=2 * GIB),
        ]
    )
    snap = monitor(fake).read([me])
    assert snap.unavailable is None
    first, second = snap.devices
    assert (first.total_bytes, first.used_bytes, first.free_bytes) == (80 * GIB, 30 * GIB, 50 * GIB)
    assert first.name == "NVIDIA H100 80GB HBM3" and first.utilization_pct == 55
    assert first.worker_bytes == 20 * GIB and first.worker_pids == (me,)
    assert second.worker_bytes == 0 and second.worker_note is None


def test_worker_tree_sums_all_its_processes() -> None:
    fake = FakePynvml([FakeDevice(UUIDS[0], procs=[(101, GIB), (102, 2 * GIB), (999, 4 * GIB)])])
    reading = monitor(fake, pid_exists=lambda pid: True).read([100, 101, 102]).devices[0]
    assert reading.worker_bytes == 3 * GIB and reading.worker_pids == (101, 102)


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [0, 1, 2]),
        ("2,0", [2, 0]),
        ("1", [1]),
        ("GPU-cccc", [2]),  # UUID prefixes are allowed, as in CUDA
        ("GPU-bbbb2222-0000,0", [1, 0]),
        ("0,7,1", [0]),  # CUDA stops at the first invalid entry
        ("GPU-", []),  # ambiguous prefix: invalid
        ("", []),
        ("-1", []),
        ("0,0", [0]),
    ],
)
def test_cuda_visible_devices(visible: str | None, expected: list[int]) -> None:
    assert parse_visible_devices(visible, UUIDS) == expected


def test_visible_devices_renumber_cuda_indices() -> None:
    fake = FakePynvml([FakeDevice(u) for u in UUIDS])
    devices = monitor(fake, visible="2,GPU-aaaa").read().devices
    assert [(d.cuda_index, d.nvml_index, d.uuid) for d in devices] == [(0, 2, UUIDS[2]), (1, 0, UUIDS[0])]


def test_all_devices_hidden_says_why() -> None:
    snap = monitor(FakePynvml([FakeDevice(UUIDS[0])]), visible="").read()
    assert snap.devices == () and "hides every GPU" in (snap.unavailable or "")


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML library not found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no permission"),
    ],
)
def test_no_driver_is_one_line_and_init_is_tried_once(code: int, words: str) -> None:
    fake = FakePynvml([], init_error=code)
    mon = monitor(fake)
    for _ in range(5):
        snap = mon.read([1])
    assert snap.devices == ()
    assert snap.unavailable is not None and words in snap.unavailable and "\n" not in snap.unavailable
    assert fake.init_calls == 1  # a machine without a GPU costs one failed init, not one per sample
    mon.close()


def test_real_pynvml_on_this_machine_degrades_gracefully() -> None:
    # Whatever this machine has, the real binding must give figures or a one-line reason.
    mon = GpuMonitor()
    snap = mon.read([os.getpid()])
    mon.close()
    assert snap.devices or (snap.unavailable and "\n" not in snap.unavailable)


def test_per_process_not_supported_falls_back_to_device() -> None:
    fake = FakePynvml([FakeDevice(UUIDS[0], errors={"procs": pynvml.NVML_ERROR_NOT_SUPPORTED})])
    reading = monitor(fake).read([os.getpid()]).devices[0]
    assert reading.worker_bytes is None and reading.used_bytes == 10 * GIB
    assert "Not Supported" in (reading.worker_note or "")


def test_used_memory_not_available_per_process() -> None:
    me = os.getpid()
    fake = FakePynvml([FakeDevice(UUIDS[0], procs=[(me, None)])])
    reading = monitor(fake).read([me]).devices[0]
    assert reading.worker_bytes is None and reading.worker_pids == (me,)
    assert "no per-process memory" in (reading.worker_note or "")


def test_mig_mode_has_no_per_process_figures() -> None:
    fake = FakePynvml([FakeDevice(UUIDS[0], mig=1, procs=[(os.getpid(), GIB)])])
    reading = monitor(fake).read([os.getpid()]).devices[0]
    assert reading.worker_bytes is None and "MIG" in (reading.worker_note or "")


def test_mig_query_not_supported_means_no_mig() -> None:
    me = os.getpid()
    fake = FakePynvml(
        [FakeDevice(UUIDS[0], procs=[(me, GIB)], errors={"mig": pynvml.NVML_ERROR_NOT_SUPPORTED})]
    )
    assert monitor(fake).read([me]).devices[0].worker_bytes == GIB


def test_container_without_host_pids() -> None:
    # NVML reports host PIDs; none of them exists in this namespace (real psutil.pid_exists).
    fake = FakePynvml([FakeDevice(UUIDS[0], procs=[(4_000_000, 8 * GIB)])])
    reading = monitor(fake).read([os.getpid()]).devices[0]
    assert reading.worker_bytes is None and "namespace" in (reading.worker_note or "")


def test_utilization_not_supported_is_none() -> None:
    fake = FakePynvml([FakeDevice(UUIDS[0], errors={"util": pynvml.NVML_ERROR_NOT_SUPPORTED})])
    assert monitor(fake).read().devices[0].utilization_pct is None


def test_lost_gpu_mid_run_keeps_other_figures() -> None:
    fake = FakePynvml([FakeDevice(UUIDS[0]), FakeDevice(UUIDS[1])])
    mon = monitor(fake)
    assert len(mon.read().devices) == 2
    fake.devices[1].errors["memory"] = pynvml.NVML_ERROR_GPU_IS_LOST
    snap = mon.read()
    assert len(snap.devices) == 1 and "GPU is lost" in (snap.unavailable or "")


def test_per_process_sm_share_since_the_last_reading() -> None:
    """The worker's own kernels, not another job's on the same GPU; samples already read are not
    read again, and no sample since then is an idle worker, not an unknown one."""
    me = os.getpid()
    device = FakeDevice(UUIDS[0], util=90, procs=[(me, GIB), (4242, GIB)], sm=[(me, 35, 10), (4242, 90, 11)])
    mon = monitor(FakePynvml([device]), pid_exists=lambda pid: True)
    assert mon.read([me]).devices[0].worker_sm_pct == 35
    assert mon.read([me]).devices[0].worker_sm_pct == 0  # nothing new since time 11
    device.sm.append((4242, 100, 20))  # only the other job ran
    assert mon.read([me]).devices[0].worker_sm_pct == 0
    device.sm.append((me, 60, 30))
    assert mon.read([me]).devices[0].worker_sm_pct == 60


def test_no_per_process_utilization_leaves_the_device_figure() -> None:
    me = os.getpid()
    refused = {"sm": pynvml.NVML_ERROR_NOT_SUPPORTED}
    fake = FakePynvml([FakeDevice(UUIDS[0], util=70, procs=[(me, GIB)], errors=refused)])
    mon = monitor(fake)
    reading = mon.read([me]).devices[0]
    assert reading.worker_sm_pct is None and reading.utilization_pct == 70 and reading.worker_bytes == GIB
    del fake.devices[0].errors["sm"]  # asked once: a device that refused is not asked every sample
    assert mon.read([me]).devices[0].worker_sm_pct is None
