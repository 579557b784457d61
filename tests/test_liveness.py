"""Liveness from the process: a silent worker is hung only when its processes and GPUs are idle too.

Scripted samples (the sampler's running totals of the worker's tree) into the pure judge; the real
processes are in test_liveness_e2e.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomguard.supervisor.observe import liveness
from oomguard.supervisor.observe.gpu import GpuReading
from oomguard.supervisor.observe.liveness import Activity, Cadence, Liveness, activity_between
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
