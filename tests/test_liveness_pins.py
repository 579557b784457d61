"""Liveness (observe/liveness.py) pinned where mutation testing (bench/mutation.py) found it loose:
each floor's boundary, the first interval measured from the attempt's start, the idle stretch's
sums, the figures a hang is recorded with, and the sizes and durations people read."""

from __future__ import annotations

from oomguard.supervisor.observe.gpu import GpuReading
from oomguard.supervisor.observe.liveness import (
    CPU_FLOOR,
    GPU_MEMORY_MOVED,
    IO_FLOOR,
    PUBLISH_EVERY,
    Activity,
    Idle,
    Judgement,
    Liveness,
    _duration,
    _size,
    activity_between,
    gpu_activity,
)
from oomguard.supervisor.observe.sampler import MemorySample

MIB = 1 << 20


def sample(t: float, cpu: float | None = 0.0, io: int | None = 0, gpus: tuple[GpuReading, ...] = (),
           unavailable: str | None = None) -> MemorySample:
    return MemorySample(monotonic=t, wall=1e9 + t, worker_pid=1, worker_rss_bytes=1, worker_pids=(1,),
                        host_total_bytes=1, host_available_bytes=1, cgroup=None, pressure=None, gpus=gpus,
                        gpu_unavailable=unavailable, worker_cpu_seconds=cpu, worker_io_bytes=io)


def gpu(util: int | None = 0, used: int = 10 * MIB, worker: int | None = None, sm: int | None = None) -> GpuReading:
    return GpuReading(0, 0, "GPU-x", "H100", 80 << 30, used, (80 << 30) - used, util, worker, (1,), worker_sm_pct=sm)


# --- one interval --------------------------------------------------------------------------------


def test_the_floors_count_as_busy_when_reached_and_scale_with_the_interval() -> None:
    assert Activity(1.0, CPU_FLOOR, 0, None).busy() == "5% of a core"
    assert Activity(2.0, CPU_FLOOR, 0, None).busy() is None
    assert Activity(1.0, 0.0, IO_FLOOR, None).busy() == "1.0 MiB of I/O in 1 s"
    assert Activity(2.0, 0.0, IO_FLOOR, None).busy() is None


def test_an_interval_is_measured_between_two_samples_and_a_missing_figure_is_unknown() -> None:
    assert activity_between(sample(5.0), sample(5.0)) is None
    a = activity_between(sample(1.0, 0.5, 3 * MIB), sample(3.0, 0.7, 8 * MIB))
    assert a is not None and a.seconds == 2.0 and a.io_bytes == 5 * MIB and isinstance(a.io_bytes, int)
    unknown = activity_between(sample(1.0, None, None), sample(2.0, 0.3, 5 * MIB))
    assert unknown is not None and unknown.cpu_seconds is None and unknown.io_bytes is None


def test_gpu_activity_at_its_floors() -> None:
    assert gpu_activity(sample(0.0), sample(1.0, gpus=(gpu(util=None, sm=1),))) == "GPU 0: its processes at 1% SM"
    assert gpu_activity(sample(0.0), sample(1.0, gpus=(gpu(util=1),))) == "GPU 0 at 1%"
    before, after = sample(0.0, gpus=(gpu(used=10 * MIB),)), sample(1.0, gpus=(gpu(used=10 * MIB + GPU_MEMORY_MOVED),))
    moved = gpu_activity(before, after)
    assert moved == "GPU 0 memory moved 2.0 MiB"


def test_another_jobs_memory_on_the_device_is_not_the_workers() -> None:
    before = sample(0.0, gpus=(gpu(used=10 * MIB, worker=4 * MIB),))
    after = sample(1.0, gpus=(gpu(used=500 * MIB, worker=4 * MIB),))
    assert gpu_activity(before, after) is None


def test_the_first_sample_is_measured_from_the_attempts_start() -> None:
    live = Liveness(0.0)
    live.add(sample(1.0, 0.0, IO_FLOOR))
    assert live.busy == "1.0 MiB of I/O in 1 s"
    quiet = Liveness(0.0)
    quiet.add(sample(1.0, 0.0, IO_FLOOR - 1))
    assert quiet.busy is None and quiet.idle is not None and quiet.idle.since == 0.0


# --- the idle stretch and the judgement ----------------------------------------------------------


def test_the_idle_stretch_sums_its_intervals_and_keeps_the_busiest_share() -> None:
    idle = Idle(0.0)
    idle.add(Activity(2.0, 0.02, 100, None))
    idle.add(Activity(3.0, 0.0, 50, None))
    assert (idle.seconds, idle.cpu_seconds, idle.io_bytes, idle.max_share) == (5.0, 0.02, 150, 0.01)


def test_a_hang_is_recorded_with_its_figures() -> None:
    live = Liveness(0.0)
    live.add(sample(1.0, 0.04444, 7))
    j = live.judge(quiet=1234.56, configured=600.26, steps_known=True, now=1300.26)
    assert j.hung == ("no progress for 1235 s (--hang-timeout 600.26); idle for 1300 s: CPU at most 4.4% of a core "
                      "(floor 5%), 7 B of I/O, no GPU figures: no GPU")
    assert j.figures == {"quiet_s": 1234.6, "timeout_s": 600.3, "timeout_from": "--hang-timeout 600.26",
                         "idle_s": 1300.3, "cpu_floor_pct": 5.0, "cpu_max_pct": 4.44, "cpu_seconds": 0.044,
                         "io_bytes": 7, "gpu": "no GPU"}


def test_without_cpu_figures_none_are_recorded() -> None:
    live = Liveness(0.0)
    live.add(sample(1.0, None, 7, unavailable="GPU figures unavailable: no NVIDIA driver"))
    j = live.judge(quiet=700.0, configured=600.0, steps_known=False, now=700.0)
    assert j.figures["cpu_max_pct"] is None and j.figures["cpu_seconds"] is None and j.figures["io_bytes"] == 7
    assert j.hung is not None and j.hung.endswith("no CPU figures of its processes")


def test_silence_of_exactly_the_timeout_is_judged_and_shorter_keeps_its_figures() -> None:
    live = Liveness(0.0)
    assert live.judge(quiet=600.0, configured=600.0, steps_known=True, now=600.0).hung is not None
    early = live.judge(quiet=599.0, configured=600.0, steps_known=True, now=600.0)
    assert early.hung is None and early.held is None and early.figures["quiet_s"] == 599.0


def test_a_held_worker_says_how_long_ago_it_was_busy_from_three_seconds() -> None:
    for since, ago in ((97.0, " 3 s ago"), (98.0, "")):
        live = Liveness(0.0)
        live.add(sample(since, 50.0, 0))  # busy up to ``since``
        j = live.judge(quiet=700.0, configured=600.0, steps_known=True, now=100.0)
        assert j.held == f"silent 12 min; busy{ago}: {100 * 50 / since:.0f}% of a core"


def test_the_held_note_is_republished_every_ten_seconds() -> None:
    live = Liveness(0.0)
    held = Judgement(None, "silent", {"quiet_s": 1.0})
    assert live.news(held, 100.0) == "held"
    assert live.news(held, 100.0 + PUBLISH_EVERY - 0.1) is None
    assert live.news(held, 100.0 + PUBLISH_EVERY) == "still held"


def test_a_learned_cadence_wins_only_when_shorter_and_names_what_it_counted() -> None:
    live = Liveness(0.0)
    for i in range(21):
        live.output.sign(60.0 * i)  # 20 gaps of 60 s over 1200 s: learned 300 s
    assert live.timeout(300.0, steps_known=False) == (300.0, "--hang-timeout 300")
    assert live.timeout(600.0, steps_known=False) == (
        300.0, "learned cadence: 20 gaps between output lines, the longest 60 s, × 5")


# --- what people read ----------------------------------------------------------------------------


def test_durations_and_sizes_switch_units_at_their_boundaries() -> None:
    assert [_duration(s) for s in (119.0, 120.0, 3000.0, 7199.0, 7200.0, 720000.0)] == [
        "119 s", "2 min", "50 min", "120 min", "2.0 h", "200.0 h"]
    assert [_size(n) for n in (1023, 1024, 2048, 3 << 30, 2048 << 30)] == [
        "1023 B", "1.0 KiB", "2.0 KiB", "3.0 GiB", "2048.0 GiB"]


def test_no_cadence_is_learned_from_fewer_than_twenty_gaps_however_long_they_span() -> None:
    live = Liveness(0.0)
    for i in range(20):
        live.steps.sign(100.0 * i)  # 19 gaps over 1900 s
    assert live.steps.timeout() is None


def test_the_cadences_span_is_measured_from_its_first_sign_not_from_zero() -> None:
    """The clock is monotonic: a run's first sign comes at any time, here 5000 s after boot. A burst
    of signs spanning less than the floor teaches nothing, however late it started."""
    from oomguard.supervisor.observe import liveness

    cadence = liveness.Cadence()
    for t in range(liveness.CADENCE_GAPS + 1):
        cadence.sign(5000.0 + t)
    assert cadence.gaps >= liveness.CADENCE_GAPS and cadence.timeout() is None
    cadence.sign(5000.0 + liveness.CADENCE_FLOOR)  # the span reaches the floor: learned
    assert cadence.timeout() == liveness.CADENCE_FACTOR * cadence.longest
