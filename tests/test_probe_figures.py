"""What the supervisor makes of the in-process probe's records (issue 27, part 3), and the cause lines
that readings censored at the ceiling may no longer produce: pure, over scripted records and series."""

from __future__ import annotations

import random
import re
from typing import Any

from oomguard.common import protocol
from oomguard.supervisor.decide.attribution import Cause, Evidence, Limit, Plateau, attribute, step_peaks
from oomguard.supervisor.decide.classify import at_oom
from oomguard.supervisor.observe.allocator import AllocatorOom, AllocatorReport
from oomguard.supervisor.observe.progress import AttemptWatch
from oomguard.supervisor.record.figures import progress_text
from oomguard.supervisor.sizing.trend import Reading
from oomguard.supervisor.sizing.tuning import SizeTuner

MIB = 2**20
GIB = 2**30
H100 = 81559 * MIB  # what NVML reports as an 80 GB H100's total


def ramp(plateau: int, n: int = 40, seed: int = 1, step0: int = 0) -> list[Reading]:
    """GPU readings of one attempt: a climb over the first steps to a level, with a little jitter."""
    rnd = random.Random(seed)
    return [Reading(float(i), min(plateau, (i + 1) * plateau // 4) + rnd.randint(-MIB, MIB), step0 + i * 10)
            for i in range(n)]


def step_record(step: int, rank: int | None = None, pid: int = 100, steps: int = 1, seconds: float = 0.5,
                allocated: int = 2 * GIB, limit: int = 24 * GIB) -> dict[str, Any]:
    return {"type": protocol.STEP, "t": 1000.0 + step, "step": step, "steps": steps, "seconds": seconds,
            "pid": pid, "rank": rank, "local_rank": rank, "world_size": None if rank is None else 2,
            "rss_bytes": 300 * MIB,
            "devices": {"cuda:0": {"allocated_peak": allocated, "reserved_peak": allocated + GIB,
                                   "limit_bytes": limit}}}


def oom_record(**fields: Any) -> dict[str, Any]:
    figures = {"device": "cuda:0", "step": 3, "requested_bytes": int(1.12 * GIB), "allocated_bytes": int(77.6 * GIB),
               "reserved_bytes": int(78.5 * GIB), "free_bytes": 300 * MIB, "total_bytes": int(79.2 * GIB),
               "fraction": None, "micro_batch": 256, "pid": 100, "rank": None, "local_rank": None,
               "world_size": None}
    return {"type": protocol.OOM, "t": 1000.0, **{**figures, **fields}}


# --- the three wrong lines, now true --------------------------------------------------------


def test_plateaus_at_the_ceiling_before_cuda_ooms_never_say_memory_does_not_follow() -> None:
    """nanoGPT on an H100: 81014 MiB read before the OOM at 512, 80132 MiB before the one at 256."""
    first = attribute(ramp(81014 * MIB), Evidence(), 512, "GPU memory", limit=Limit("GPU", H100, ramp(81014 * MIB)))
    earlier = [Plateau(512, first.figures["plateau_bytes"], first.figures["plateau_censored"])]
    second = attribute(ramp(80132 * MIB, seed=2), Evidence(), 256, "GPU memory",
                       limit=Limit("GPU", H100, ramp(80132 * MIB, seed=2)), earlier=earlier)
    for found in (first, second):
        assert found.cause is Cause.PER_SAMPLE
        assert "does not follow" not in found.summary and "stayed level" not in found.summary, found.summary
    assert "at least 8101" in second.summary and "at least 8013" in second.summary
    assert "lower bounds" in second.summary and second.figures["follows"] is None


def test_a_plateau_read_between_two_samples_is_a_lower_bound_not_a_shrinking_batch_growing() -> None:
    """Lightning: 2658 MiB read at 256 before an OOM that came between two samples; more at 128."""
    first = attribute(ramp(2658 * MIB), Evidence(), 256, "GPU memory", limit=Limit("GPU", H100, ramp(2658 * MIB)))
    assert "came between two readings" in first.summary and "at least 265" in first.summary, first.summary
    earlier = [Plateau(256, first.figures["plateau_bytes"], first.figures["plateau_censored"])]
    second = attribute(ramp(5120 * MIB), Evidence(), 128, "GPU memory", limit=Limit("GPU", H100, ramp(5120 * MIB)),
                       earlier=earlier)
    assert "grew as the micro-batch shrank" not in second.summary and "follow" not in second.summary
    assert re.search(r"at least 265\d MiB at 256, at least 51\d\d MiB at 128", second.summary), second.summary


def test_readings_that_saw_none_of_the_memory_are_no_trend_under_a_fraction() -> None:
    """Two DDP ranks under set_per_process_memory_fraction: NVML's per-process figure was 0."""
    zeros = [Reading(float(i), 0, i * 10) for i in range(40)]
    found = attribute(zeros, Evidence(capacity=24320 * MIB), 64, "GPU memory",
                      limit=Limit("process's GPU", 24320 * MIB, zeros))
    assert "trend was 0 MiB" not in found.summary and "24320 MiB below" not in found.summary, found.summary
    assert "saw none of its memory" in found.summary and "plateau_bytes" not in found.figures


def test_a_planned_restart_measures_plateaus_that_may_be_compared() -> None:
    measured = attribute(ramp(400 * MIB), Evidence(), 64, failed=False,
                         earlier=[Plateau(128, 800 * MIB, False)])
    assert measured.figures["plateau_censored"] is False and "memory follows the micro-batch" in measured.summary


# --- with the probe: the allocator's words and figures ------------------------------------------------


def test_a_cuda_oom_with_the_probe_is_told_in_the_allocators_figures() -> None:
    alloc = AllocatorOom.from_record(oom_record())
    assert alloc is not None
    found = attribute(ramp(81014 * MIB), Evidence(allocator=alloc, step_peaks={128: 128 * 290 * MIB}), 256,
                      "GPU memory", limit=Limit("GPU", H100, ramp(81014 * MIB)))
    assert found.cause is Cause.PER_SAMPLE
    assert found.summary == (
        "per-sample: needed 1.1 GiB more with 77.6 GiB allocated of 79.2 GiB at micro-batch 256 "
        "(921.6 MiB reserved but unallocated); at most 290.0 MiB per sample measured at 128"), found.summary
    assert found.figures["source"] == "allocator" and found.figures["measured_at"] == [128]
    assert "does not follow" not in found.summary


def test_the_per_sample_figure_is_the_slope_through_two_measured_sizes_and_the_fraction_is_the_limit() -> None:
    alloc = AllocatorOom.from_record(oom_record(fraction=0.3, total_bytes=80 * GIB, allocated_bytes=23 * GIB,
                                                reserved_bytes=23 * GIB, micro_batch=64))
    assert alloc is not None and alloc.limit == 24 * GIB
    peaks = {32: 4 * GIB + 32 * 256 * MIB, 16: 4 * GIB + 16 * 256 * MIB, 64: 30 * GIB}  # 64 is the failed size
    found = attribute([], Evidence(allocator=alloc, step_peaks=peaks), 64)
    assert "with 23.0 GiB allocated of 24.0 GiB (30% of the device) at micro-batch 64" in found.summary
    assert found.summary.endswith("; 256.0 MiB per sample measured at 32 and 16"), found.summary


def test_step_peaks_come_from_the_journals_attempts() -> None:
    rows = [{"micro_batch": 64, "peak_allocated": None}, {"micro_batch": 32, "peak_allocated": 3 * GIB},
            {"micro_batch": 32, "peak_allocated": 4 * GIB}, {"micro_batch": 16}]
    assert step_peaks(rows) == {32: 4 * GIB}


def test_fragmentation_is_judged_from_the_allocators_reserved_but_unallocated() -> None:
    alloc = AllocatorOom.from_record(oom_record(requested_bytes=GIB, allocated_bytes=60 * GIB,
                                                reserved_bytes=76 * GIB))
    # The OOM message's figures (read from text) would say otherwise: the allocator's come first.
    found = at_oom(alloc, 2 * GIB, 512 * MIB, int(79.11 * GIB))
    assert found.fragmented and "16.0 GiB reserved but unallocated" in found.why
    assert "allocator's figures" in found.why
    assert not at_oom(None, 2 * GIB, 512 * MIB, int(79.11 * GIB)).fragmented
    tight = at_oom(AllocatorOom.from_record(oom_record()), None, None, None)
    assert not tight.fragmented and "921.6 MiB reserved but unallocated" in tight.why


# --- steps and the memory model ------------------------------------------------------------------------


def test_probe_steps_come_first_and_text_steps_no_longer_move_the_count() -> None:
    watch = AttemptWatch()
    watch.feed_line("step 7: loss 2.1")  # before the probe speaks, the output is the fallback
    assert watch.last_step == 7
    for step in (1, 2, 3):
        for rank, pid in ((0, 100), (1, 101)):  # two ranks report the same step
            watch.take(step_record(step, rank, pid), float(step))
    watch.feed_line("step 9000: loss 2.0")
    watch.feed_line(" 30%|###       | 3/10 [00:01<00:03]")  # a bar's total still gives the ETA
    watch.take(step_record(4, 0, 100), 4.0)
    assert watch.last_step == 4 and watch.total_steps == 10
    assert watch.progress is not None and watch.progress["source"] == "probe"
    assert watch.progress["steps_per_s"] == 2.0  # rank 0's steps over its own seconds, not both ranks'
    assert watch.progress["eta_s"] == 3.0  # 6 steps left at 2 steps/s
    assert watch.progressed and watch.allocator.allocated_peak == 2 * GIB and watch.allocator.limit_bytes == 24 * GIB
    assert "step 4/10, 2 steps/s, ETA 0 min; allocated peak 2.0 GiB of 24.0 GiB [probe]" in progress_text(
        watch.progress)


def test_the_learned_cadence_comes_from_the_probes_steps() -> None:
    watch = AttemptWatch()
    for i in range(25):  # a step every 20 s for 8 minutes, whatever the output shows
        watch.take(step_record(i + 1), 100.0 + i * 20.0)
    judgement = watch.check_hang(0.0, 3600.0, 100.0 + 24 * 20.0 + 1.0)
    assert judgement is not None and judgement.hung is None
    assert judgement.figures["timeout_s"] == 300.0 and "gaps between steps" in judgement.figures["timeout_from"]


def test_a_resumed_attempts_count_continues_from_the_probes_step() -> None:
    watch = AttemptWatch()
    watch.take(step_record(601), 1.0)
    watch.take(step_record(602), 2.0)
    assert watch.last_step == 602 and watch.first_step == 601


def test_the_memory_model_takes_the_allocators_step_peak_and_the_fractions_limit() -> None:
    probe = AllocatorReport()
    probe.take(step_record(1, allocated=6 * GIB, limit=24 * GIB))
    probe.take(step_record(2, allocated=8 * GIB, limit=24 * GIB))
    tuner = SizeTuner(per_process_batch=64, min_micro=1, margin=0.1)
    assert tuner.peak_bytes(None, None, probe) == 8 * GIB
    assert tuner.capacity(None) == 24 * GIB  # the fraction's cap, not the device
    tuner.record(16, 8 * GIB, memory_failed=False)
    grow = tuner.growth(16, 8 * GIB, None)
    assert grow is not None and grow.micro_batch == 32  # 16 GiB at 32 fits under 24 GiB × 0.9; 64 does not
    rows = [{"kind": None, "ended": 1.0, "micro_batch": 16, "peak_allocated": 8 * GIB, "peak_gpu": 9 * GIB,
             "peak_rss": GIB}]
    assert SizeTuner.points_from_attempts(rows)[0].peak_bytes == 8 * GIB


def test_an_oom_record_of_the_host_is_no_allocator_figure() -> None:
    assert AllocatorOom.from_record(oom_record(device="cpu")) is None
    probe = AllocatorReport()
    assert not probe.take(oom_record(device="cpu")) and probe.oom is None
    probe.take(oom_record(requested_bytes=1))
    probe.take(oom_record())
    probe.take(oom_record(device="cpu"))
    assert probe.oom is not None and probe.oom.requested == int(1.12 * GIB)  # the newest CUDA OOM is the one


def test_the_forecast_and_a_leak_are_measured_on_the_allocators_step_peaks_against_its_limit() -> None:
    """NVML sees no per-process figure here; the probe's step peaks rise 64 MiB a second toward the
    fraction's 24 GiB cap: the forecast names the allocator, and the CUDA OOM at the cap is a leak."""
    from oomguard.supervisor.decide.classify import FailureKind
    from oomguard.supervisor.observe.sampler import MemorySample
    from oomguard.supervisor.run.trendwatch import TrendWatch

    watch = TrendWatch()
    found = None
    for i in range(60):
        sample = MemorySample(float(i), float(i), 1, 300 * MIB, (1,), 64 * GIB, 32 * GIB, None, None)
        found = watch.add(sample, i * 10, None, 0.95, (20 * GIB + i * 64 * MIB, 24 * GIB))
    assert found is not None and found.budget == "allocator" and found.limit == int(24 * GIB * 0.95)
    assert watch.leaking()
    blamed = watch.attribute(Evidence(), 16, kind=FailureKind.CUDA_OOM, failed_at=61.0)
    assert blamed.cause is Cause.LEAK and "allocator grew" in blamed.summary, blamed.summary
    assert "the 24576 MiB limit" in blamed.summary


def test_metrics_export_the_probes_figures() -> None:
    from oomguard.web.metrics import _progress

    progress = {"step": 12, "steps_per_s": 2.5, "allocated_peak": 2 * GIB, "limit_bytes": 24 * GIB}
    values = {m.name: m.samples[0].value for m in _progress({"progress": progress})}
    assert values == {"oomguard_step": 12.0, "oomguard_steps_per_second": 2.5,
                      "oomguard_allocated_peak_bytes": float(2 * GIB),
                      "oomguard_allocator_limit_bytes": float(24 * GIB)}
