"""Hang detection's edges, each pinned where a small change would move it (issue 30): the worker
library's progress records make steps known (so its chatter is not progress), and a learned cadence
needs both enough gaps and a span of at least ``CADENCE_FLOOR`` seconds."""

from __future__ import annotations

from oomguard.common import protocol
from oomguard.supervisor.observe import liveness
from oomguard.supervisor.observe.liveness import Cadence
from oomguard.supervisor.observe.progress import AttemptWatch
from oomguard.supervisor.observe.sampler import MemorySample


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
