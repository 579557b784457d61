"""Liveness from the process: a silent worker is hung only when its processes and GPUs are idle too.

Scripted samples (the sampler's running totals of the worker's tree) into the pure judge; the real
processes are in tests/e2e/test_liveness.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomguard.common import protocol
from oomguard.supervisor.observe import liveness
from oomguard.supervisor.observe.gpu import GpuReading
from oomguard.supervisor.observe.liveness import (
    CPU_FLOOR,
    GPU_MEMORY_MOVED,
    IO_FLOOR,
    PUBLISH_EVERY,
    Activity,
    Cadence,
    Idle,
    Judgement,
    Liveness,
    _duration,
    _size,
    activity_between,
    gpu_activity,
)
from oomguard.supervisor.observe.progress import AttemptWatch, StepSeen
from oomguard.supervisor.observe.sampler import MemorySample

MIB = 1 << 20


def sample(t: float, cpu: float | None, io: int | None = 0, gpus: tuple[GpuReading, ...] = ()) -> MemorySample:
    return MemorySample(monotonic=t, wall=1e9 + t, worker_pid=1, worker_rss_bytes=1, worker_pids=(1,),
                        host_total_bytes=1, host_available_bytes=1, cgroup=None, pressure=None, gpus=gpus,
                        gpu_unavailable=None if gpus else "GPU figures unavailable: no NVIDIA driver",
                        worker_cpu_seconds=cpu, worker_io_bytes=io)


def gpu(util: int | None = 0, used: int = 10 * MIB, worker: int | None = None, sm: int | None = None) -> GpuReading:
    return GpuReading(0, 0, "GPU-x", "H100", 80 << 30, used, (80 << 30) - used, util, worker, (1,),
                      worker_sm_pct=sm)


@pytest.mark.parametrize(("activity", "why"), [
    (Activity(1.0, 0.97, 0, None), "97% of a core"),
    (Activity(1.0, 1.9, 0, None), "190% of a core"),  # two DataLoader workers and the trainer
    (Activity(1.0, 0.01, 0, None), None),  # one clock tick: the DataLoader's 5 s status check
    (Activity(0.25, 0.01, 0, None), None),  # one tick in a quarter second is still noise, not 4% of a core
    (Activity(0.25, 0.1, 0, None), "40% of a core"),
    (Activity(1.0, 0.0, 5 * MIB, None), "5.0 MiB of I/O in 1 s"),  # writing a checkpoint to slow storage
    (Activity(1.0, 0.0, 4096, None), None),
    (Activity(1.0, 0.0, 0, "GPU 0 at 100%"), "GPU 0 at 100%"),  # a collective spinning on the GPU
    (Activity(1.0, None, None, None), None),
])
def test_what_counts_as_busy(activity: Activity, why: str | None) -> None:
    assert activity.busy() == why


def test_gpu_activity_per_process_where_nvml_gives_it() -> None:
    before = sample(0.0, 0.0, gpus=(gpu(),))
    # another job's kernels at 90% on a shared GPU; the worker's own processes ran none
    assert activity_between(before, sample(1.0, 0.0, gpus=(gpu(util=90, sm=0),))).gpu is None  # type: ignore[union-attr]
    assert activity_between(before, sample(1.0, 0.0, gpus=(gpu(util=90, sm=35),))).gpu == (  # type: ignore[union-attr]
        "GPU 0: its processes at 35% SM")
    # without per-process figures the device's utilization stands in
    assert activity_between(before, sample(1.0, 0.0, gpus=(gpu(util=90),))).gpu == "GPU 0 at 90%"  # type: ignore[union-attr]
    # memory moving counts (its own processes' figure where there is one)
    moved = sample(1.0, 0.0, gpus=(gpu(used=400 * MIB),))
    assert activity_between(before, moved).gpu == "GPU 0 memory moved 390.0 MiB"  # type: ignore[union-attr]
    steady = sample(1.0, 0.0, gpus=(gpu(used=10 * MIB + 4096),))
    assert activity_between(before, steady).gpu is None  # type: ignore[union-attr]


def feed(live: Liveness, start: float, end: float, cpu_per_s: float, step: float = 1.0, gpus: tuple = ()) -> None:
    """Samples every ``step`` seconds over [start, end] of a tree using ``cpu_per_s`` of a core."""
    cpu = live.previous.worker_cpu_seconds if live.previous is not None else 0.0
    t = start
    while t < end - 1e-9:
        t = min(end, t + step)
        cpu = (cpu or 0.0) + cpu_per_s * step
        live.add(sample(t, cpu, gpus=gpus))


def test_a_busy_silent_worker_is_held_alive_never_hung() -> None:
    live = Liveness(started=0.0)
    feed(live, 0.0, 60.0, cpu_per_s=0.97)
    judgement = live.judge(quiet=60.0, configured=20.0, steps_known=False, now=60.0)
    assert judgement.hung is None
    assert judgement.held == "silent 60 s; busy: 97% of a core"
    assert judgement.figures["busy"] == "97% of a core" and judgement.figures["timeout_s"] == 20.0


def test_a_blocked_worker_is_hung_within_the_timeout_and_one_sampling_period() -> None:
    """It printed its last line at t=10 and blocked at once (a lock, a pipe): the interval that
    ends at the next sample still holds the CPU it used before, so the idle stretch starts there."""
    live = Liveness(started=0.0)
    feed(live, 0.0, 10.5, cpu_per_s=0.9, step=1.5)  # samples at 1.5, 3, ..., 10.5
    feed(live, 10.5, 40.0, cpu_per_s=0.0, step=1.5)
    last_line = 10.0
    for now in (30.0, 30.4):  # 20 s after the last line: the idle stretch began at 10.5
        assert live.judge(now - last_line, 20.0, False, now).hung is None
    judgement = live.judge(30.5 - last_line, 20.0, False, 30.5)
    assert judgement.hung == ("no output or progress for 20 s (--hang-timeout 20); idle for 20 s: CPU at most "
                              "0.0% of a core (floor 5%), 0 B of I/O, no GPU figures: no NVIDIA driver")
    assert judgement.figures["idle_s"] == 20.0 and judgement.figures["cpu_max_pct"] == 0.0
    assert judgement.figures["gpu"].startswith("GPU figures unavailable")


def test_busy_then_idle_counts_from_when_it_went_idle() -> None:
    live = Liveness(started=0.0)
    feed(live, 0.0, 50.0, cpu_per_s=1.0)  # silent since 0, busy until 50 (a long epoch), then stuck
    feed(live, 50.0, 65.0, cpu_per_s=0.002)  # a tick now and then: the DataLoader's status check
    judgement = live.judge(quiet=65.0, configured=20.0, steps_known=False, now=65.0)
    assert judgement.hung is None and judgement.held == "silent 65 s; busy 15 s ago: 100% of a core"
    feed(live, 65.0, 70.0, cpu_per_s=0.002)
    judgement = live.judge(quiet=70.0, configured=20.0, steps_known=False, now=70.0)
    assert judgement.hung is not None and "idle for 20 s: CPU at most 0.2% of a core" in judgement.hung
    assert judgement.figures["cpu_seconds"] == pytest.approx(0.04)


def test_the_gpu_keeps_a_silent_idle_cpu_worker_alive() -> None:
    live = Liveness(started=0.0)
    feed(live, 0.0, 60.0, cpu_per_s=0.0, gpus=(gpu(util=100),))  # a collective spinning: torch's watchdog's to end
    judgement = live.judge(quiet=60.0, configured=20.0, steps_known=True, now=60.0)
    assert judgement.hung is None and judgement.held == "silent 60 s; busy: GPU 0 at 100%"


def test_without_cpu_figures_silence_alone_decides_as_before() -> None:
    live = Liveness(started=0.0)
    for t in range(1, 31):
        live.add(sample(float(t), None, None))
    judgement = live.judge(quiet=25.0, configured=20.0, steps_known=True, now=30.0)
    assert judgement.hung == "no progress for 25 s (--hang-timeout 20); no CPU figures of its processes"


def test_a_steady_cadence_finds_a_stall_sooner_and_never_cuts_a_slow_steady_job() -> None:
    cadence = Cadence()
    for i in range(20):
        cadence.sign(10.0 * i)  # 19 gaps: not enough yet
    assert cadence.timeout() is None
    for i in range(20, 40):
        cadence.sign(10.0 * i)
    assert cadence.gaps == 39 and cadence.timeout() == liveness.CADENCE_FLOOR  # 5 × 10 s is under the floor

    live = Liveness(started=0.0)
    for i in range(40):
        live.steps.sign(20.0 * i)  # a step every 20 s for 13 min
    last = 20.0 * 39 + 70
    live.steps.sign(last)  # once a 70 s gap (an evaluation)
    assert live.timeout(1800.0, steps_known=True) == (
        350.0, "learned cadence: 40 gaps between steps, the longest 70 s, × 5")
    feed(live, 0.0, last, cpu_per_s=1.0)
    feed(live, last, last + 400, cpu_per_s=0.0)  # stuck after its last step, idle
    assert live.judge(349.0, 1800.0, True, last + 349).hung is None
    hung = live.judge(351.0, 1800.0, True, last + 351).hung
    assert hung is not None and hung.startswith("no progress for 351 s (learned cadence: 40 gaps")

    slow = Liveness(started=0.0)
    for i in range(30):
        slow.steps.sign(600.0 * i)  # a step every 10 min: 5 × 10 min is past --hang-timeout
    assert slow.timeout(1800.0, steps_known=True) == (1800.0, "--hang-timeout 1800")


def test_output_lines_learn_only_where_no_steps_are_known() -> None:
    live = Liveness(started=0.0)
    for i in range(400):
        live.output.sign(float(i))  # a line a second, for 400 s
    assert live.timeout(1800.0, steps_known=False)[0] == liveness.CADENCE_FLOOR
    assert live.timeout(1800.0, steps_known=True) == (1800.0, "--hang-timeout 1800")  # steps: none seen


def test_the_held_note_is_said_when_it_starts_refreshed_and_when_it_ends() -> None:
    live = Liveness(started=0.0)
    feed(live, 0.0, 30.0, cpu_per_s=1.0)
    held = live.judge(25.0, 20.0, False, 30.0)
    assert live.news(held, 30.0) == "held"
    assert live.news(held, 35.0) is None
    assert live.news(held, 41.0) == "still held"
    note = held.note(3, 1000.0)
    assert note == {"attempt": 3, "text": "silent 25 s; busy: 100% of a core", "busy": "100% of a core",
                    "silent_since": 975.0, "t": 1000.0}
    quiet = live.judge(1.0, 20.0, False, 42.0)
    assert live.news(quiet, 42.0) == "released" and quiet.note(3, 1001.0) is None
    assert live.news(quiet, 60.0) is None


def test_attempt_watch_hangs_on_silence_and_idleness_together() -> None:
    watch = AttemptWatch(started=0.0)
    watch.note_step(StepSeen(1, 10), now=1.0, wall=1.0)
    watch.note_step(StepSeen(2, 10), now=2.0, wall=2.0)
    for t in range(3, 40):  # busy, printing warnings without a new step
        watch.observe(sample(float(t), 0.9 * t))
    judgement = watch.check_hang(last_output=39.0, timeout=10.0, now=39.0)
    assert judgement is not None and judgement.hung is None and judgement.held is not None
    assert judgement.held.startswith("silent 37 s; busy: 90% of a core")
    for t in range(40, 52):  # now stuck
        watch.observe(sample(float(t), 0.9 * 39))
    assert watch.hang_reason(last_output=51.0, timeout=10.0, now=51.0) is not None
    assert watch.check_hang(51.0, timeout=0.0, now=51.0) is None  # --hang-timeout 0: off


def test_a_checkpoint_with_a_step_is_progress_at_that_step() -> None:
    watch = AttemptWatch(started=0.0)
    watch.checkpoint_landed(4, now=5.0, wall=105.0)
    assert watch.last_step == 4 and watch.new_checkpoint and watch.last_progress == 5.0
    assert watch.progress is not None and watch.progress["source"] == "checkpoint"
    assert watch.output_steps == 0  # not a step from the output: output still counts as life
    watch.checkpoint_landed(2, now=6.0, wall=106.0)  # an older one settling late
    assert watch.last_step == 4
    watch.note_step(StepSeen(3, None), now=7.0, wall=107.0)  # the bar lags: not a step back
    assert watch.last_step == 4


def test_first_interval_runs_from_the_attempt_start() -> None:
    live = Liveness(started=100.0)
    live.add(sample(101.0, 0.8))  # 0.8 s of CPU since the worker started
    assert live.busy == "80% of a core"
    live2 = Liveness(started=100.0)
    live2.add(replace(sample(101.0, 0.0), worker_cpu_seconds=0.0))
    assert live2.busy is None and live2.idle is not None and live2.idle.since == 100.0


def test_idle_gpus_do_not_keep_a_hung_worker_alive() -> None:
    live = Liveness(started=0.0)
    feed(live, 0.0, 30.0, cpu_per_s=0.0, gpus=(gpu(util=0, worker=2 << 30, sm=0),))  # memory held, nothing running
    judgement = live.judge(quiet=30.0, configured=20.0, steps_known=True, now=30.0)
    assert judgement.hung is not None and judgement.hung.endswith("0 B of I/O, its GPUs idle")
    assert judgement.figures["gpu"] == "idle"


# --- merged from tests/test_liveness_pins.py ----------------------------------------------------------------
# Liveness (observe/liveness.py) pinned where mutation testing (bench/mutation.py) found it loose:
# each floor's boundary, the first interval measured from the attempt's start, the idle stretch's
# sums, the figures a hang is recorded with, and the sizes and durations people read.




def sample_at(t: float, cpu: float | None = 0.0, io: int | None = 0, gpus: tuple[GpuReading, ...] = (),
           unavailable: str | None = None) -> MemorySample:
    return MemorySample(monotonic=t, wall=1e9 + t, worker_pid=1, worker_rss_bytes=1, worker_pids=(1,),
                        host_total_bytes=1, host_available_bytes=1, cgroup=None, pressure=None, gpus=gpus,
                        gpu_unavailable=unavailable, worker_cpu_seconds=cpu, worker_io_bytes=io)


def gpu_at(util: int | None = 0, used: int = 10 * MIB, worker: int | None = None, sm: int | None = None) -> GpuReading:
    return GpuReading(0, 0, "GPU-x", "H100", 80 << 30, used, (80 << 30) - used, util, worker, (1,), worker_sm_pct=sm)


# --- one interval --------------------------------------------------------------------------------


def test_the_floors_count_as_busy_when_reached_and_scale_with_the_interval() -> None:
    assert Activity(1.0, CPU_FLOOR, 0, None).busy() == "5% of a core"
    assert Activity(2.0, CPU_FLOOR, 0, None).busy() is None
    assert Activity(1.0, 0.0, IO_FLOOR, None).busy() == "1.0 MiB of I/O in 1 s"
    assert Activity(2.0, 0.0, IO_FLOOR, None).busy() is None


def test_an_interval_is_measured_between_two_samples_and_a_missing_figure_is_unknown() -> None:
    assert activity_between(sample_at(5.0), sample_at(5.0)) is None
    a = activity_between(sample_at(1.0, 0.5, 3 * MIB), sample_at(3.0, 0.7, 8 * MIB))
    assert a is not None and a.seconds == 2.0 and a.io_bytes == 5 * MIB and isinstance(a.io_bytes, int)
    unknown = activity_between(sample_at(1.0, None, None), sample_at(2.0, 0.3, 5 * MIB))
    assert unknown is not None and unknown.cpu_seconds is None and unknown.io_bytes is None


def test_gpu_activity_at_its_floors() -> None:
    at_one_percent_sm = sample_at(1.0, gpus=(gpu_at(util=None, sm=1),))
    assert gpu_activity(sample_at(0.0), at_one_percent_sm) == "GPU 0: its processes at 1% SM"
    assert gpu_activity(sample_at(0.0), sample_at(1.0, gpus=(gpu_at(util=1),))) == "GPU 0 at 1%"
    before = sample_at(0.0, gpus=(gpu_at(used=10 * MIB),))
    after = sample_at(1.0, gpus=(gpu_at(used=10 * MIB + GPU_MEMORY_MOVED),))
    moved = gpu_activity(before, after)
    assert moved == "GPU 0 memory moved 2.0 MiB"


def test_another_jobs_memory_on_the_device_is_not_the_workers() -> None:
    before = sample_at(0.0, gpus=(gpu_at(used=10 * MIB, worker=4 * MIB),))
    after = sample_at(1.0, gpus=(gpu_at(used=500 * MIB, worker=4 * MIB),))
    assert gpu_activity(before, after) is None


def test_the_first_sample_is_measured_from_the_attempts_start() -> None:
    live = Liveness(0.0)
    live.add(sample_at(1.0, 0.0, IO_FLOOR))
    assert live.busy == "1.0 MiB of I/O in 1 s"
    quiet = Liveness(0.0)
    quiet.add(sample_at(1.0, 0.0, IO_FLOOR - 1))
    assert quiet.busy is None and quiet.idle is not None and quiet.idle.since == 0.0


# --- the idle stretch and the judgement ----------------------------------------------------------


def test_the_idle_stretch_sums_its_intervals_and_keeps_the_busiest_share() -> None:
    idle = Idle(0.0)
    idle.add(Activity(2.0, 0.02, 100, None))
    idle.add(Activity(3.0, 0.0, 50, None))
    assert (idle.seconds, idle.cpu_seconds, idle.io_bytes, idle.max_share) == (5.0, 0.02, 150, 0.01)


def test_a_hang_is_recorded_with_its_figures() -> None:
    live = Liveness(0.0)
    live.add(sample_at(1.0, 0.04444, 7))
    j = live.judge(quiet=1234.56, configured=600.26, steps_known=True, now=1300.26)
    assert j.hung == ("no progress for 1235 s (--hang-timeout 600.26); idle for 1300 s: CPU at most 4.4% of a core "
                      "(floor 5%), 7 B of I/O, no GPU figures: no GPU")
    assert j.figures == {"quiet_s": 1234.6, "timeout_s": 600.3, "timeout_from": "--hang-timeout 600.26",
                         "idle_s": 1300.3, "cpu_floor_pct": 5.0, "cpu_max_pct": 4.44, "cpu_seconds": 0.044,
                         "io_bytes": 7, "gpu": "no GPU"}


def test_without_cpu_figures_none_are_recorded() -> None:
    live = Liveness(0.0)
    live.add(sample_at(1.0, None, 7, unavailable="GPU figures unavailable: no NVIDIA driver"))
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
        live.add(sample_at(since, 50.0, 0))  # busy up to ``since``
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


# --- merged from tests/test_hang_edges.py -------------------------------------------------------------------
# Hang detection's edges, each pinned where a small change would move it (issue 30): the worker
# library's progress records make steps known (so its chatter is not progress), and a learned cadence
# needs both enough gaps and a span of at least ``CADENCE_FLOOR`` seconds.


def idle_sample(t: float) -> MemorySample:
    """The worker's tree at ``t``: no CPU used since the start, no I/O, no GPU."""
    return MemorySample(monotonic=t, wall=1e9 + t, worker_pid=1, worker_rss_bytes=1, worker_pids=(1,),
                        host_total_bytes=1, host_available_bytes=1, cgroup=None, pressure=None, gpus=(),
                        gpu_unavailable="GPU figures unavailable: no NVIDIA driver", worker_cpu_seconds=0.0,
                        worker_io_bytes=0)


def stuck_after_two_steps(records: bool) -> AttemptWatch:
    """Two steps (as the worker library's records, or none at all), then idle until t=100."""
    watch = AttemptWatch(started=0.0)
    watch.last_progress = 0.0
    if records:
        for step in (1, 2):
            watch.take({"type": protocol.PROGRESS, "step": step, "t": 1e9 + step}, now=float(step))
    for t in range(1, 101):
        watch.observe(idle_sample(float(t)))
    return watch


def test_a_library_worker_printing_warnings_without_a_step_is_hung() -> None:
    """Its last progress record was at t=2; it printed a warning a moment ago (last output at t=100).
    Steps are known from the records, so the warnings are not progress."""
    watch = stuck_after_two_steps(records=True)
    assert watch.progress_records == 2 and watch.output_steps == 0
    judgement = watch.check_hang(last_output=100.0, timeout=50.0, now=100.0)
    assert judgement is not None and judgement.hung is not None
    assert judgement.hung.startswith("no progress for 98 s (--hang-timeout 50); idle for ")


def test_without_known_steps_the_same_output_is_life() -> None:
    """The contrast: no records and no step lines, so a line printed a moment ago is life."""
    watch = stuck_after_two_steps(records=False)
    judgement = watch.check_hang(last_output=100.0, timeout=50.0, now=100.0)
    assert judgement is not None and judgement.hung is None
    silent = watch.check_hang(last_output=40.0, timeout=50.0, now=100.0)
    assert silent is not None and (silent.hung or "").startswith("no output or progress for 60 s")


def test_a_cadence_is_learned_only_over_the_floors_span() -> None:
    """Enough gaps in a short burst (a fast start) teach nothing: the rhythm must span at least
    CADENCE_FLOOR seconds, counted from the first sign to the last."""
    floor = liveness.CADENCE_FLOOR
    cadence = Cadence()
    for t in range(int(floor)):  # a sign a second: 299 gaps spanning 299 s
        cadence.sign(float(t))
    assert cadence.gaps >= liveness.CADENCE_GAPS and cadence.timeout() is None
    cadence.sign(floor)  # the span reaches the floor
    assert cadence.timeout() == floor


def test_a_cadence_needs_its_gaps_even_over_a_long_span() -> None:
    cadence = Cadence()
    for i in range(liveness.CADENCE_GAPS):  # 19 gaps over 1900 s
        cadence.sign(100.0 * i)
    assert cadence.timeout() is None
    cadence.sign(100.0 * liveness.CADENCE_GAPS)
    assert cadence.timeout() == liveness.CADENCE_FACTOR * 100.0
