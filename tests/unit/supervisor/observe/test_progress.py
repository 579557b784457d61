"""What the loop learns while an attempt runs (observe/progress.py), pinned where mutation testing
(bench/mutation.py) found it loose: the worker's records, steps read from the output, checkpoints as
progress, the resume check's feed and the cooldown of a checkpoint request."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support import TESTS

from oomguard.common import protocol
from oomguard.supervisor.decide.attribution import Cause, Evidence, Limit, Plateau, attribute, step_peaks
from oomguard.supervisor.decide.classify import at_oom
from oomguard.supervisor.observe import checkpoints as ckptstep
from oomguard.supervisor.observe import progress
from oomguard.supervisor.observe.allocator import AllocatorOom, AllocatorReport
from oomguard.supervisor.observe.checkpoints import ResumeCheck, StepEvidence
from oomguard.supervisor.observe.gpu import GpuReading
from oomguard.supervisor.observe.progress import (
    CPU_FLOOR,
    GPU_MEMORY_MOVED,
    IO_FLOOR,
    MTIME_SLACK,
    PROGRESS_EVENT_EVERY,
    PUBLISH_EVERY,
    REQUEST_COOLDOWN,
    STAMP_SLACK,
    Activity,
    AttemptWatch,
    Cadence,
    Idle,
    Judgement,
    Liveness,
    StepMatcher,
    StepSeen,
    activity_between,
    compile_pattern,
    duration,
    gpu_activity,
)
from oomguard.supervisor.observe.sampler import MemorySample
from oomguard.supervisor.record.report import progress_text
from oomguard.supervisor.sizing.memmodel import SizeTuner
from oomguard.supervisor.sizing.trend import Reading
from oomguard.supervisor.units import format_size


def watch() -> AttemptWatch:
    return AttemptWatch(started=0.0, last_progress=0.0)


def sample(t: float, rss: int) -> MemorySample:
    return MemorySample(t, 1000.0 + t, 10, rss, (10,), 8 << 30, 4 << 30, None, None)


# --- the worker library's records ----------------------------------------------------------------


def test_a_progress_record_is_journaled_at_most_every_ten_seconds() -> None:
    w = watch()
    record = {"type": protocol.PROGRESS, "step": 7}
    assert w.take(record, 100.0) is True
    assert w.take({"type": protocol.PROGRESS, "step": 8}, 100.0 + PROGRESS_EVENT_EVERY - 0.5) is False
    assert w.take({"type": protocol.PROGRESS, "step": 9}, 100.0 + PROGRESS_EVENT_EVERY) is True
    assert w.last_step == 9 and w.progress == {"type": protocol.PROGRESS, "step": 9}
    assert w.last_progress == 100.0 + PROGRESS_EVENT_EVERY and w.liveness.steps.last == 100.0 + PROGRESS_EVENT_EVERY


def test_a_progress_record_without_a_step_keeps_the_last_one() -> None:
    w = watch()
    w.take({"type": protocol.PROGRESS, "step": 5}, 1.0)
    w.take({"type": protocol.PROGRESS, "loss": 0.5}, 2.0)
    assert w.last_step == 5


def test_life_signs_refresh_progress_and_other_records_do_not() -> None:
    w = watch()
    assert w.take({"type": protocol.HEARTBEAT, "step": 1}, 5.0) is False  # a heartbeat is no event
    assert w.last_progress == 5.0
    # The probe's "loaded" is counted in the meta (one per process), its failures are events; neither is life.
    assert w.take({"type": protocol.PROBE, "state": "loaded", "pid": 7}, 9.0) is False
    assert w.take({"type": protocol.PROBE, "state": "failed", "pid": 7, "detail": "x"}, 9.5) is True
    assert w.last_progress == 5.0 and w.worker_failure is None and w.probe.as_meta()["processes"] == 1


def test_the_workers_failure_record_is_kept() -> None:
    w = watch()
    record = {"type": protocol.FAILURE, "kind": "cuda_oom", "message": "CUDA out of memory"}
    assert w.take(record, 3.0) is True
    assert w.worker_failure == record


def test_the_resume_check_hears_the_records_step_and_ignores_a_shorter_bars() -> None:
    w = watch()
    w.resume = ResumeCheck("ckpt/step-40", 40)
    w.take({"type": protocol.PROGRESS, "step": 5, "total_steps": 10}, 1.0)  # another bar, not training
    assert w.resume.verdict is None
    w.take({"type": protocol.PROGRESS, "step": 41, "total_steps": 100}, 2.0)
    assert w.resume.verdict is not None and w.resume.verdict.first_step == 41


# --- steps read from the output ------------------------------------------------------------------


def test_a_carriage_return_bar_counts_its_newest_state() -> None:
    w = watch()
    w.feed_line("step 1/10\rstep 2/10\rstep 3/10")
    assert w.last_step == 3 and w.liveness.output.last is not None
    assert w.step_at(w.steps_at[-1][0]) == 3


def test_the_output_resume_check_ignores_a_bar_no_longer_than_the_checkpoints_step() -> None:
    w = watch()
    w.resume = ResumeCheck("ckpt/step-40", 40)
    w.note_step(StepSeen(5, 10), 1.0, 1.0)
    assert w.resume.verdict is None


def test_a_longer_bar_after_a_loading_bar_is_the_training_and_starts_its_rate_over() -> None:
    w = watch()
    w.note_step(StepSeen(2, 2), 1.0, 1.0)  # Loading checkpoint shards 2/2
    w.note_step(StepSeen(1, 1000), 2.0, 2.0)
    assert w.last_step == 1 and w.total_steps == 1000 and w.first_progress == 2.0
    w.note_step(StepSeen(11, 1000), 12.0, 12.0)
    assert w.progress is not None and w.progress["eta_s"] == 989.0


def test_the_progress_of_an_output_step_is_a_full_record() -> None:
    w = watch()
    w.note_step(StepSeen(1, 100), 1.0, 50.0)
    assert w.progress == {"type": protocol.PROGRESS, "step": 1, "total_steps": 100, "eta_s": None, "t": 50.0,
                          "source": "output"}
    assert w.liveness.steps.last == 1.0
    w.note_step(StepSeen(2, 100), 1.0, 50.0)  # read in the same instant: no rate yet, no division by zero
    assert w.progress["eta_s"] is None
    w.note_step(StepSeen(100, 100), 3.0, 52.0)
    assert w.progress["eta_s"] == 0.0


def test_the_step_times_keep_the_newest_256() -> None:
    w = watch()
    for step in range(1, 301):
        w.note_step(StepSeen(step, None), float(step), float(step))
    assert len(w.steps_at) == 256 and w.steps_at[0] == (45.0, 45)


def test_a_step_stamped_a_quarter_second_after_a_checkpoint_still_counts_for_it() -> None:
    w = watch()
    w.note_step(StepSeen(9, None), 1.0, 100.0 + STAMP_SLACK)
    assert w.step_at(100.0) == 9


# --- checkpoints, peaks, requests, hangs ---------------------------------------------------------


def test_a_checkpoint_at_a_newer_step_is_progress_with_a_full_record() -> None:
    w = watch()
    w.total_steps = 500
    w.checkpoint_landed(40, 2.0, 60.0)
    assert w.progress == {"type": protocol.PROGRESS, "step": 40, "total_steps": 500, "eta_s": None, "t": 60.0,
                          "source": "checkpoint"}
    seen = {"type": protocol.PROGRESS, "step": 41}
    w.progress, w.last_step = seen, 41
    w.checkpoint_landed(41, 3.0, 61.0)  # the step the output already showed: nothing new
    assert w.progress is seen


def test_the_peak_is_the_largest_sample() -> None:
    w = watch()
    w.observe(sample(1.0, 300))
    w.observe(sample(2.0, 200))
    assert w.peak_rss == 300


def test_a_checkpoint_request_is_pending_only_while_its_file_is_there_and_fresh() -> None:
    w = watch()
    assert not w.request_pending(True, 0.0)  # none written yet
    w.last_request = 100.0
    assert w.request_pending(True, 100.0 + REQUEST_COOLDOWN - 1)
    assert not w.request_pending(True, 100.0 + REQUEST_COOLDOWN)
    assert not w.request_pending(False, 101.0)


def test_a_hang_timeout_under_a_second_still_judges_and_zero_turns_it_off() -> None:
    w = watch()
    assert (judged := w.check_hang(0.0, 0.5, 10.0)) is not None and judged.hung is not None
    assert w.check_hang(0.0, 0, 10.0) is None


def test_output_steps_make_output_without_a_step_silence() -> None:
    w = watch()
    w.note_step(StepSeen(1, None), 1.0, 1.0)
    judgement = w.check_hang(last_output=99.0, timeout=50.0, now=100.0)
    assert judgement is not None and judgement.hung is not None and "no progress for 99 s" in judgement.hung


# --- the probe's save records: which save wrote a checkpoint, and its step ----------------------


def save(path: str | None, began: float, returned: float, step: int, pid: int = 7) -> dict[str, object]:
    return {"type": "save", "t": returned, "started": began, "step": step, "path": path, "pid": pid}


def test_a_save_long_returned_says_nothing_of_a_later_mtime() -> None:
    """An mtime after every save's return (by more than a coarse clock's tick) is no save's: the step
    records at that time stand, not the save that began before it."""
    w = watch()
    w.take(save(None, 100.3, 100.32, 3), 0.0)
    w.take({"type": "step", "t": 101.0, "step": 7, "steps": 7, "pid": 7}, 0.0)
    assert w.step_at(101.5) == 7


def test_between_two_saves_a_tie_goes_to_the_later() -> None:
    """An mtime as far after one save's return as before the next one's start: the later save, since
    a coarse clock's mtime lags the time it stands for, never leads it. (Binary fractions: the two
    distances are exactly equal.)"""
    w = watch()
    w.take(save(None, 100.0, 100.25, 3), 0.0)
    w.take(save(None, 100.28125, 100.5, 4), 0.0)
    assert w.step_at(100.265625) == 4


def test_inside_two_saves_at_once_the_one_recorded_last_counts() -> None:
    """Two processes (or an asynchronous save beside a synchronous one) saving over the same moment:
    the mtime lies inside both, at distance 0 from each, and the save recorded last wins, however
    deep inside either the mtime lies."""
    w = watch()
    w.take(save(None, 100.0, 100.6, 3, pid=7), 0.0)
    w.take(save(None, 100.4, 101.0, 4, pid=8), 0.0)
    assert w.step_at(100.45) == 4


def test_a_save_exactly_a_tick_away_still_counts() -> None:
    """The coarse clock's slack is inclusive on both sides of a save. (Times near 0, where 0.05 is
    exactly the distance computed.)"""
    w = watch()
    w.take(save(None, 0.0, 0.0, 3), 0.0)
    assert w.step_at(MTIME_SLACK) == 3
    later = watch()
    later.take(save(None, 2 * MTIME_SLACK, 0.2, 4), 0.0)
    assert later.step_at(MTIME_SLACK) == 4


def test_a_files_save_brackets_its_mtime_within_a_tick_inclusive(tmp_path: Path) -> None:
    """``saved_step``: a file's mtime may read a tick before its save began (the kernel's coarse
    clock lags time.time()) or a tick after it returned; exactly a tick is still inside."""
    ckpt = str(tmp_path / "ckpt.pt")
    w = watch()
    w.take(save(ckpt, 102.0, 102.2, 80), 0.0)
    assert w.saved_step(ckpt, 101.99, directory=False) == 80  # a tick before the save began
    assert w.saved_step(ckpt, 101.9, directory=False) is None  # more than a tick before: another write
    mtime = 105.0
    edges = watch()
    edges.take(save(ckpt, mtime + MTIME_SLACK, mtime + 1, 90), 0.0)
    assert edges.saved_step(ckpt, mtime, directory=False) == 90
    assert edges.saved_step(str(tmp_path), mtime, directory=True) == 90  # a directory's too
    edges = watch()
    edges.take(save(ckpt, mtime - 1, mtime - MTIME_SLACK, 91), 0.0)
    assert edges.saved_step(ckpt, mtime, directory=False) == 91


def test_a_save_to_a_buffer_or_a_file_object_wrote_no_checkpoint(tmp_path: Path) -> None:
    w = watch()
    w.take(save(None, 100.0, 100.2, 3), 0.0)  # torch.save(state, io.BytesIO()): no path
    assert w.saved_step(str(tmp_path / "ckpt.pt"), 100.1, directory=False) is None
    assert w.saved_step(str(tmp_path), 100.1, directory=True) is None
    assert w.step_at(100.1) == 3  # its time still says which step was being saved


def test_the_newest_64_saves_are_kept(tmp_path: Path) -> None:
    w = watch()
    for i in range(65):
        w.take(save(str(tmp_path / f"ckpt-{i}.pt"), 100.0 + i, 100.5 + i, i), 0.0)
    assert len(w.saves) == 64
    assert w.saved_step(str(tmp_path / "ckpt-0.pt"), 100.2, directory=False) is None  # the 65th pushed it out
    assert w.saved_step(str(tmp_path / "ckpt-1.pt"), 101.2, directory=False) == 1


# --- merged from tests/test_probe_figures.py ----------------------------------------------------------------
# What the supervisor makes of the in-process probe's records (issue 27, part 3), and the cause lines
# that readings censored at the ceiling may no longer produce: pure, over scripted records and series.


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
    assert "at least 79.1 GiB at 512, at least 78.3 GiB at 256" in second.summary, second.summary
    assert "lower bounds" in second.summary and second.figures["follows"] is None


def test_a_plateau_read_between_two_samples_is_a_lower_bound_not_a_shrinking_batch_growing() -> None:
    """Lightning: 2658 MiB read at 256 before an OOM that came between two samples; more at 128."""
    first = attribute(ramp(2658 * MIB), Evidence(), 256, "GPU memory", limit=Limit("GPU", H100, ramp(2658 * MIB)))
    assert "came between two readings" in first.summary and "at least 2.6 GiB" in first.summary, first.summary
    earlier = [Plateau(256, first.figures["plateau_bytes"], first.figures["plateau_censored"])]
    second = attribute(ramp(5120 * MIB), Evidence(), 128, "GPU memory", limit=Limit("GPU", H100, ramp(5120 * MIB)),
                       earlier=earlier)
    assert "grew as the micro-batch shrank" not in second.summary and "follow" not in second.summary
    assert re.search(r"at least 2\.6 GiB at 256, at least 5\.0 GiB at 128", second.summary), second.summary
    assert 2658 * MIB <= second.figures["plateaus"]["256"] < 2660 * MIB  # the figures to the byte stay in the data


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
        "micro-batch 256 needed at least 78.7 GiB: it asked for 1.1 GiB more with 77.6 GiB allocated; the limit was "
        "79.2 GiB; 921.6 MiB more was reserved but unallocated; at most 290.0 MiB a sample, measured at 128"), \
        found.summary
    assert found.figures["source"] == "allocator" and found.figures["measured_at"] == [128]
    assert "does not follow" not in found.summary


def test_the_per_sample_figure_is_the_slope_through_two_measured_sizes_and_the_fraction_is_the_limit() -> None:
    alloc = AllocatorOom.from_record(oom_record(fraction=0.3, total_bytes=80 * GIB, allocated_bytes=23 * GIB,
                                                reserved_bytes=23 * GIB, micro_batch=64))
    assert alloc is not None and alloc.limit == 24 * GIB
    peaks = {32: 4 * GIB + 32 * 256 * MIB, 16: 4 * GIB + 16 * 256 * MIB, 64: 30 * GIB}  # 64 is the failed size
    found = attribute([], Evidence(allocator=alloc, step_peaks=peaks), 64)
    assert "micro-batch 64 needed at least 24.1 GiB: it asked for 1.1 GiB more with 23.0 GiB allocated; the limit " \
           "was 24.0 GiB (30% of the device)" in found.summary, found.summary
    assert found.summary.endswith("; about 256.0 MiB a sample, measured at 32 and 16"), found.summary


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
    from oomguard.supervisor.run.attempt import TrendWatch

    watch = TrendWatch()
    found = None
    for i in range(60):
        sample = MemorySample(float(i), float(i), 1, 300 * MIB, (1,), 64 * GIB, 32 * GIB, None, None)
        found = watch.add(sample, i * 10, None, 0.95, (20 * GIB + i * 64 * MIB, 24 * GIB))
    assert found is not None and found.budget == "allocator" and found.limit == int(24 * GIB * 0.95)
    assert watch.leaking()
    blamed = watch.attribute(Evidence(), 16, kind=FailureKind.CUDA_OOM, failed_at=61.0)
    assert blamed.cause is Cause.LEAK and "allocator rose steadily" in blamed.summary, blamed.summary
    assert "had reached the allocator limit of 24.0 GiB" in blamed.summary


def test_metrics_export_the_probes_figures() -> None:
    from oomguard.web.metrics import _progress

    progress = {"step": 12, "steps_per_s": 2.5, "allocated_peak": 2 * GIB, "limit_bytes": 24 * GIB}
    values = {m.name: m.samples[0].value for m in _progress({"progress": progress})}
    assert values == {"oomguard_step": 12.0, "oomguard_steps_per_second": 2.5,
                      "oomguard_allocated_peak_bytes": float(2 * GIB),
                      "oomguard_allocator_limit_bytes": float(24 * GIB)}


# --- merged from tests/test_progress_probe_pins.py ----------------------------------------------------------
# The progress the in-process probe's step records make (docs/mutation.md: the survivors these pin):
# when each step happened by the record's own clock, the ETA, the resume check's feed, and one record
# being enough to make steps known.


def test_each_probe_step_is_placed_at_its_records_time_the_last_256_kept() -> None:
    """A checkpoint without a step in its name (nanoGPT's ckpt.pt) takes the step the probe had
    reached when it was written: the record's ``t`` (step N at 1000 + N), not when it was read."""
    watch = AttemptWatch()
    for step in range(1, 301):
        watch.take(step_record(step), 5.0)
        watch.take(step_record(step), 5.0)  # a second rank at the same step adds nothing
    assert watch.step_at(1200.0) == 200 and watch.step_at(1200.5) == 200
    assert watch.step_at(1045.0) == 45 and watch.step_at(1044.5) is None  # older than the last 256 steps
    assert watch.progress is not None and watch.progress["type"] == protocol.PROGRESS
    assert watch.progress["t"] == 1300.0 and watch.progress["step"] == 300


def test_the_eta_at_the_last_step_is_zero() -> None:
    watch = AttemptWatch()
    watch.feed_line(" 30%|###       | 3/4 [00:01<00:03]")
    watch.take(step_record(3), 1.0)
    watch.take(step_record(4), 2.0)
    assert watch.progress is not None and watch.progress["eta_s"] == 0.0


def test_a_host_oom_record_is_an_event_not_a_step() -> None:
    watch = AttemptWatch()
    assert watch.take(oom_record(device="cpu"), 1.0) is True
    assert watch.last_step is None


def test_probe_steps_feed_the_resume_check_with_the_runs_total() -> None:
    """Resumed from step 500: a run whose total (400) is below it is a new run, not a start-over."""
    watch = AttemptWatch(resume=ResumeCheck("ckpt-500", 500))
    watch.feed_line(" 1%|          | 3/400 [00:01<02:00]")
    watch.take(step_record(10), 1.0)
    assert watch.resume is not None and watch.resume.verdict is None
    resumed = AttemptWatch(resume=ResumeCheck("ckpt-500", 500))
    resumed.take(step_record(501), 1.0)
    assert resumed.resume is not None and resumed.resume.verdict is not None
    assert resumed.resume.verdict.first_step == 501


def test_one_step_record_makes_steps_known_so_output_alone_is_no_progress() -> None:
    watch = AttemptWatch()
    watch.take(step_record(1), 10.0)
    judgement = watch.check_hang(last_output=100.0, timeout=60.0, now=100.0)
    assert judgement is not None and judgement.figures["quiet_s"] == 90.0
    library = AttemptWatch()
    library.take({"type": protocol.PROGRESS, "step": 1, "total_steps": None}, 10.0)
    judgement = library.check_hang(last_output=100.0, timeout=60.0, now=100.0)
    assert judgement is not None and judgement.figures["quiet_s"] == 90.0


def test_with_the_probe_counting_a_line_without_a_total_keeps_the_bars_total() -> None:
    watch = AttemptWatch()
    watch.take(step_record(3), 1.0)
    watch.feed_line(" 30%|###       | 3/10 [00:01<00:03]")
    watch.feed_line("step 9: loss 2.0")
    assert watch.total_steps == 10 and watch.last_step == 3


def test_a_step_record_without_its_own_time_is_placed_when_it_was_read() -> None:
    record = step_record(1)
    del record["t"]
    watch = AttemptWatch()
    watch.take(record, 1.0)
    assert watch.progress is not None and watch.progress["t"] > 1e9  # the wall clock, not a missing stamp


# --- merged from tests/test_steps.py ------------------------------------------------------------------------
# Progress read from the output of scripts that do not use the worker library.


@pytest.mark.parametrize("line,expected", [
    ("iter 120: loss 3.2100, time 41.23ms, mfu 12.34%", StepSeen(120, None)),  # nanoGPT
    ("step 250: train loss 2.9012, val loss 3.0011", StepSeen(250, None)),  # nanoGPT eval
    (" 40%|████      | 40/100 [00:12<00:18,  3.30it/s]", StepSeen(40, 100)),  # HF Trainer's tqdm bar
    ("{'loss': 3.2, 'grad_norm': 1.1, 'learning_rate': 5e-05, 'epoch': 0.5}\r 40%|████ | 40/100 [00:12<00:18]",
     StepSeen(40, 100)),
    ("Epoch 2:  45%|████▌     | 45/100 [00:03<00:04, 13.52it/s, v_num=0, train_loss=2.31]", StepSeen(245, None)),
    ("step 00120/01000 (12.00%) | loss: 3.210000 | lrm: 1.00 | dt: 41.23ms", StepSeen(120, 1000)),  # nanochat
    ("Step: 120 / 1000, loss=2.1", StepSeen(120, 1000)),
    ("global_step=77 loss=1.0", StepSeen(77, None)),
    ("12/100 [00:01<00:09, 9.8it/s]", StepSeen(12, 100)),  # a bare tqdm bar
    ("loading data shard 3", None),
    ("saving checkpoint to out", None),
])
def test_builtin_patterns(line: str, expected: StepSeen | None) -> None:
    seen = StepMatcher().match(line.rsplit("\r", 1)[-1])
    assert seen == expected


def test_custom_pattern_first_and_validated() -> None:
    matcher = StepMatcher(r"it=(?P<step>\d+) of (?P<total>\d+)")
    assert matcher.match("it=5 of 9 step 3") == StepSeen(5, 9)
    with pytest.raises(ValueError, match="named group 'step'"):
        compile_pattern(r"it=(\d+)")
    with pytest.raises(ValueError, match="not a regular expression"):
        compile_pattern(r"it=(?P<step>\d+")


def test_watch_counts_steps_going_up_and_output_alone_is_not_progress() -> None:
    watch = AttemptWatch()
    watch.feed_line("iter 10: loss 3.0")
    first = watch.last_progress
    watch.feed_line("iter 11: loss 3.0")
    watch.feed_line("iter 11: loss 3.0")  # repeated: not a new step
    watch.feed_line("some warning")
    assert watch.last_step == 11 and watch.output_steps == 2 and watch.progressed
    # steps are known, so a chatty worker without new steps hangs: output does not reset the clock
    now = watch.last_progress + 100
    judged = watch.check_hang(last_output=now, timeout=50, now=now)
    assert judged is not None and (judged.hung or "").startswith("no progress for 100 s")
    assert first <= watch.last_progress


def test_without_steps_output_still_counts() -> None:
    watch = AttemptWatch()
    watch.feed_line("hello")
    now = watch.last_progress + 100
    assert (judged := watch.check_hang(last_output=now - 1, timeout=50, now=now)) is not None and judged.hung is None


def test_bars_an_eval_bar_is_ignored_and_a_longer_bar_takes_over() -> None:
    watch = AttemptWatch()
    watch.feed_line("Loading checkpoint shards: 100%|██████████| 2/2 [00:00<00:00]")
    watch.feed_line(" 10%|█         | 10/100 [00:01<00:09, 9.8it/s]")
    watch.feed_line("100%|██████████| 5/5 [00:00<00:00, 30.1it/s]")  # evaluation
    watch.feed_line(" 20%|██        | 20/100 [00:02<00:08, 9.8it/s]")
    assert watch.last_step == 20 and watch.progress is not None and watch.progress["total_steps"] == 100


def test_eta_and_the_step_a_checkpoint_was_written_at() -> None:
    watch = AttemptWatch()
    watch.note_step(StepSeen(100, 1000), now=10.0, wall=1000.0)
    watch.note_step(StepSeen(200, 1000), now=20.0, wall=1010.0)
    assert watch.progress is not None and watch.progress["eta_s"] == pytest.approx(80.0)
    assert watch.step_at(1005.0) == 100 and watch.step_at(1009.9) == 200 and watch.step_at(999.0) is None


def test_the_total_outlives_the_journaled_progress_record() -> None:
    watch = AttemptWatch()
    watch.feed_line(" 10%|█         | 10/100 [00:01<00:09, 9.8it/s]")
    watch.progress = None  # the loop journals it with the next sample and clears it
    watch.feed_line("100%|██████████| 5/5 [00:00<00:00, 30.1it/s]")  # evaluation: still ignored
    watch.feed_line(" 11%|█         | 11/100 [00:01<00:09, 9.8it/s]")
    assert watch.last_step == 11 and watch.progress is not None and watch.progress["total_steps"] == 100


def test_a_checkpoint_rewritten_at_a_later_step_is_progress_the_same_step_is_not(tmp_path: Path) -> None:
    from oomguard.supervisor.record.journal import Journal

    journal = Journal(tmp_path)
    ckpt = str(tmp_path / "out" / "ckpt.pt")
    assert journal.checkpoint_seen(ckpt, 3, 100.0, 1)
    assert not journal.checkpoint_seen(ckpt, None, 100.0, None)  # seen again, unchanged
    assert not journal.checkpoint_seen(ckpt, 3, 110.0, 2)  # nanoGPT re-saves at once after resuming
    assert journal.checkpoint_seen(ckpt, 6, 120.0, 2)  # a later step: progress
    assert [(c["step"], c["mtime"]) for c in journal.checkpoints()] == [(6, 120.0)]
    # Rewritten again, and seen only once its step can no longer be told (at the restart): the file's
    # step is unknown now, not the 6 it held before.
    assert journal.checkpoint_seen(ckpt, None, 130.0, None)
    assert [(c["step"], c["mtime"], c["attempt"]) for c in journal.checkpoints()] == [(None, 130.0, None)]
    assert [(w["step"], w["mtime"]) for w in journal.checkpoint_writes()] == [
        (3, 100.0), (3, 110.0), (6, 120.0), (None, 130.0)]
    journal.close()


def test_stable_running_for_grow_after_counts_from_the_first_step() -> None:
    watch = AttemptWatch()
    assert watch.running_since() == watch.started  # no steps known: from the start
    watch.note_step(StepSeen(1, None), now=watch.started + 40.0, wall=0.0)  # 40 s loading the model
    assert watch.running_since() == watch.started + 40.0


@pytest.mark.parametrize("line", [
    # what the issue saw read as step 4 after a resume, and its kin: numbers of files, not of training
    "Restoring states from the checkpoint path at ckpts/epoch=0-step=4.ckpt",
    "Restored all states from the checkpoint at /tmp/run/epoch=0-step=4.ckpt",
    "saved epoch=0-step=4.ckpt",
    "[transformers] Saving model checkpoint to out/checkpoint-500",
    "[transformers] Deleting older checkpoint [out/checkpoint-500] due to args.save_total_limit",
    "[transformers]   Continuing training from global step 500",
    "Resuming optimization from step 250",
    "Resumed from checkpoint: out/step_4",
    "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 180.33it/s]",
    "Sanity Checking DataLoader 0: 100%|██████████| 2/2 [00:00<00:00,  3.91it/s]",
    "Validation DataLoader 0:  50%|█████     | 1/2 [00:00<00:00, 11.81it/s]\x1b[A",
    "{'loss': '9.636', 'grad_norm': '0.2173', 'learning_rate': '0.001', 'epoch': '0.1667'}",  # 'epoch' is no step
    "{'train_runtime': '11.8', 'train_steps_per_second': '0.509', 'train_loss': '9.637', 'epoch': '1'}",
])
def test_no_step_from_paths_file_names_or_checkpoint_messages(line: str) -> None:
    assert StepMatcher().match(line) is None


def test_a_bar_glued_to_a_checkpoint_message_still_gives_its_step() -> None:
    line = " 33%|███▎      | 2/6 [00:03<00:07,  1.81s/it][transformers] Saving model checkpoint to out/checkpoint-2"
    assert StepMatcher().match(line) == StepSeen(2, 6)


@pytest.mark.parametrize(("line", "per_step", "expected"), [
    # Lightning counts batches within an epoch; with accumulation 2 four batches are two optimizer steps
    ("Epoch 1/2  ━━━━━━━╸━━━━━━━━━ 4/8 0:00:02 • 0:00:03 1.69it/s v_num: 0.000", 2, StepSeen(6, 12)),
    ("\x1b[2KEpoch 1/2  \x1b[35m━━━━━━\x1b[0m\x1b[90m╺━━━━━━━\x1b[0m 4/8 \x1b[2m0:00:02 • 0:00:03\x1b[0m", 2,
     StepSeen(6, 12)),  # the same bar rendered for a terminal
    ("Epoch 2/-1  ━━━━━━━━━━━━━━━━━ 8/8 0:00:04 • 0:00:00", 4, StepSeen(6, None)),  # no epoch limit: no total
    ("Epoch 1:  50%|█████     | 4/8 [00:01<00:01,  3.70it/s, v_num=0, train_loss=0.943]", 2, StepSeen(6, None)),
])
def test_lightning_bars_in_optimizer_steps(line: str, per_step: int, expected: StepSeen) -> None:
    assert StepMatcher(batches_per_step=per_step).match(line) == expected


def test_a_checkpoint_takes_the_step_of_the_probes_save_not_the_last_step_record() -> None:
    """The failure seen end to end: step records come at most every half second, so the last one
    before nanoGPT's ckpt.pt was written said step 1 while the save was made after step 3 (the
    report said it resumed from step 1). The probe's ``save`` record brackets the file's mtime."""
    watch = AttemptWatch()
    watch.take({"type": "step", "t": 100.0, "step": 1, "steps": 1, "pid": 7}, 0.0)
    assert watch.step_at(100.3) == 1  # without the save record: only the lower bound
    assert not watch.take({"type": "save", "t": 100.32, "started": 100.3, "step": 3, "path": None, "pid": 7}, 0.0)
    watch.take({"type": "step", "t": 100.5, "step": 4, "steps": 3, "pid": 7}, 0.0)
    watch.take({"type": "save", "t": 100.35, "started": 100.34, "step": 4, "path": None, "pid": 7}, 0.0)
    assert watch.step_at(100.31) == 3 and watch.step_at(100.28) == 3  # the mtime's coarse clock lags a tick
    assert watch.step_at(100.34) == 4  # two saves near: the one running at the mtime
    assert watch.step_at(100.2) == 1 and watch.step_at(100.6) == 4  # no save then: the step records
    # nanoGPT re-saves right after resuming, before the first step reads the resumed count: no step
    # from the save (its count would say 0), the output's or step records' stand.
    watch.take({"type": "save", "t": 100.61, "started": 100.6, "step": None, "path": None, "pid": 7}, 0.0)
    assert watch.step_at(100.6) == 4


def save_steps(path: str | None, began: float, returned: float, step: int | None) -> dict:  # type: ignore[type-arg]
    return {"type": "save", "t": returned, "started": began, "step": step, "path": path, "pid": 7}


def test_a_checkpoints_step_is_its_own_saves_the_file_or_a_file_inside_its_directory(tmp_path: Path) -> None:
    """The probe's save record names the file: a file takes the save whose run holds its mtime (a
    rewrite of nanoGPT's ckpt.pt takes its own), a directory the newest save into it by its mtime
    (HF writes trainer_state.json after optimizer.pt, so the directory's mtime is later)."""
    watch = AttemptWatch()
    ckpt, hf = str(tmp_path / "ckpt.pt"), tmp_path / "checkpoint-500"
    watch.take(save_steps(ckpt, 100.0, 100.2, 40), 0.0)
    watch.take(save_steps(str(hf / "optimizer.pt"), 101.0, 101.5, 500), 0.0)
    watch.take(save_steps(str(tmp_path / "checkpoint-5000" / "optimizer.pt"), 101.6, 101.7, 5000), 0.0)
    watch.take(save_steps(ckpt, 102.0, 102.2, 80), 0.0)
    watch.take(save_steps(ckpt, 103.0, 103.2, None), 0.0)  # before this process's first step: no step
    assert watch.saved_step(ckpt, 100.1, directory=False) == 40
    assert watch.saved_step(ckpt, 102.23, directory=False) == 80  # a coarse clock's tick after it returned
    assert watch.saved_step(ckpt, 103.1, directory=False) is None  # the save that wrote it said no step
    assert watch.saved_step(str(hf), 101.9, directory=True) == 500  # not checkpoint-5000's, a longer name
    assert watch.saved_step(str(hf), 100.5, directory=True) is None  # written before any save into it
    assert watch.saved_step(str(hf / "optimizer.pt"), 101.2, directory=False) == 500
    assert watch.saved_step(str(tmp_path / "other.pt"), 100.1, directory=False) is None
    link = tmp_path / "run"
    link.symlink_to(tmp_path, target_is_directory=True)
    assert watch.saved_step(str(link / "ckpt.pt"), 100.1, directory=False) == 40  # the same file by another path


def test_a_checkpoint_saved_under_a_temp_name_and_renamed_takes_that_saves_step(tmp_path: Path) -> None:
    """Atomic writers torch.save to a temp name and rename it into place (nanoGPT-style
    ``ckpt.pt.tmp``, ``.step_2.pt.tmp``, accelerate-style ``.step_4.tmp/``, ``tmp-checkpoint-6/``):
    the save record names the temp path, the index only ever sees the final one, and a rename keeps
    the mtime. The save's measured step must still count, above a name that says another (step_800,
    micro-batches under accumulation 4) and above the step reported at the mtime."""
    watch = AttemptWatch()
    watch.take(save_steps(str(tmp_path / "ckpt.pt.tmp"), 100.0, 100.2, 3), 0.0)
    watch.take(save_steps(str(tmp_path / ".step_800.pt.tmp"), 101.0, 101.2, 200), 0.0)
    watch.take(save_steps(str(tmp_path / ".step_4.tmp" / "optimizer.bin"), 102.0, 102.2, 4), 0.0)
    watch.take(save_steps(str(tmp_path / "tmp-checkpoint-6" / "optimizer.pt"), 103.0, 103.2, 6), 0.0)
    watch.take(save_steps(str(tmp_path / "other.pt.tmp"), 104.0, 104.2, 9), 0.0)
    assert watch.saved_step(str(tmp_path / "ckpt.pt"), 100.1, directory=False) == 3
    assert watch.saved_step(str(tmp_path / "step_800.pt"), 101.1, directory=False) == 200
    assert watch.saved_step(str(tmp_path / "step_4"), 102.3, directory=True) == 4
    assert watch.saved_step(str(tmp_path / "checkpoint-6"), 103.3, directory=True) == 6
    # Another file's temp, a temp in another directory, or the temp's own name are not this file's.
    assert watch.saved_step(str(tmp_path / "ckpt.pt"), 104.1, directory=False) is None
    assert watch.saved_step(str(tmp_path / "sub" / "ckpt.pt"), 100.1, directory=False) is None
    assert watch.saved_step(str(tmp_path / "step_40"), 102.3, directory=True) is None


def test_the_save_record_beats_the_name_and_the_name_beats_the_step_at_its_mtime() -> None:
    """accelerate's ``step_{overall_step}`` counts micro-batches: with accumulation 4 its step_800
    holds optimizer step 200, the count every other step oomguard reports is in."""
    named = StepEvidence(800, ckptstep.NAME)
    assert ckptstep.resolve(200, named, 199) == StepEvidence(200, ckptstep.SAVE)
    assert ckptstep.resolve(None, named, 199) == named
    assert ckptstep.resolve(None, StepEvidence(None, None), 199) == StepEvidence(199, ckptstep.OUTPUT)
    assert ckptstep.resolve(None, StepEvidence(None, None), None) == StepEvidence(None, None)


# --- merged from tests/test_steps_pins.py -------------------------------------------------------------------
# The step reader's edges that mutation testing showed unpinned (docs/mutation.md): a path in a
# line is taken out whichever path character it has, the length cut-off, and Lightning's single-epoch
# and accumulated bars.


@pytest.mark.parametrize("line", [
    "wandb: Find logs at: wandb/run-step 3/logs",  # a slash only
    "metrics in step 3.json",  # a file name only
    "run name lr=3-step=5",  # a name formatted from metrics only
    "logs at C:\\runs\\step 7\\events",  # a Windows path only
])
def test_a_step_inside_a_path_or_a_file_name_is_no_progress(line: str) -> None:
    assert StepMatcher().match(line) is None


def test_a_line_of_2000_characters_is_read_one_longer_is_not() -> None:
    matcher = StepMatcher()
    line = "step 12"
    assert matcher.match(line.ljust(2000)) == StepSeen(12, None)
    assert matcher.match(line.ljust(2001)) is None


def test_a_single_epoch_rich_bar_has_a_total_and_accumulation_keeps_it_whole() -> None:
    bar = "Epoch 0/0  ━━━━━━━━━━╸━━━━━━━━━ 5/8 0:00:04 • 0:00:03 1.69it/s v_num: 0"
    assert StepMatcher().match(bar) == StepSeen(5, 8)
    seen = StepMatcher(batches_per_step=3).match(bar)
    assert seen == StepSeen(1, 2) and isinstance(seen.total, int)
    endless = "Epoch 2/-1  ━━━━━━━━━━╸━━━━━━━━━ 5/8 0:00:04 • 0:00:03 1.69it/s v_num: 0"  # max_epochs=-1
    assert StepMatcher().match(endless) == StepSeen(21, None)


# --- merged from tests/test_progress_corpus.py --------------------------------------------------------------
# The step matcher against real output: every line captured from Lightning (Rich into a pipe, Rich
# rendered, TQDM), the Hugging Face Trainer (its bar with INFO logging, and silent), an Accelerate script,
# nanoGPT and nanochat, each labelled with the step it shows (tests/progress_corpus/capture.py).


CORPUS = TESTS / "progress_corpus"
SOURCES = sorted(p.stem for p in CORPUS.glob("*.jsonl"))


def load(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    header, *records = (json.loads(line) for line in (CORPUS / f"{name}.jsonl").read_text().splitlines())
    return header, records


def test_the_corpus_covers_every_framework_and_the_lines_that_fooled_the_matcher() -> None:
    assert {"lightning_rich_pipe", "lightning_rich_terminal", "lightning_tqdm", "hf_trainer_tqdm", "hf_trainer_silent",
            "accelerate_no_trainer", "nanogpt", "nanochat"} <= set(SOURCES)
    lines = [r["line"] for name in SOURCES for r in load(name)[1]]
    for needed in (r"Restoring states from the checkpoint path at \S+/epoch=\d+-step=\d+\.ckpt",
                   r"Saving model checkpoint to \S+/checkpoint-\d+", r"global step \d+",
                   r"Writing model shards: +\d+%", r"Sanity Checking DataLoader", r"'epoch': ",
                   r"Saving current state to \S+/step_\d+", r"Resuming training from",
                   r"Resuming optimization from step"):
        assert any(re.search(needed, line) for line in lines), needed


@pytest.mark.parametrize("name", SOURCES)
def test_every_line_gives_the_step_it_shows_or_none(name: str) -> None:
    header, records = load(name)
    matcher = StepMatcher(batches_per_step=header["batches_per_step"])
    wrong = []
    for record in records:
        seen = matcher.match(record["line"])
        got = (seen.step, seen.total) if seen else None
        expected = (record["step"], record["total"]) if record["step"] is not None else None
        if got != expected:
            wrong.append((record["line"], got, expected))
    assert not wrong, f"{len(wrong)} of {len(records)} lines read wrong, e.g. {wrong[:3]}"


@pytest.mark.parametrize("name", SOURCES)
def test_each_run_ends_at_its_last_step(name: str) -> None:
    """Fed in order, as the output thread does, each run's last step is the highest it showed;
    status ends there."""
    header, records = load(name)
    for run in ("first", "resumed"):
        watch = AttemptWatch(matcher=StepMatcher(batches_per_step=header["batches_per_step"]))
        lines = [r for r in records if r["run"] == run]
        for record in lines:
            watch.feed_line(record["line"])
        steps = [r["step"] for r in lines if r["step"] is not None]
        assert watch.last_step == (max(steps) if steps else None), run


# Liveness from the process: a silent worker is hung only when its processes and GPUs are idle too.
#
# Scripted samples (the sampler's running totals of the worker's tree) into the pure judge; the real
# processes are in tests/e2e/test_liveness.py.


MIB = 1 << 20


def cpu_sample(t: float, cpu: float | None, io: int | None = 0, gpus: tuple[GpuReading, ...] = ()) -> MemorySample:
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
    before = cpu_sample(0.0, 0.0, gpus=(gpu(),))
    # another job's kernels at 90% on a shared GPU; the worker's own processes ran none
    assert activity_between(before, cpu_sample(1.0, 0.0, gpus=(gpu(util=90, sm=0),))).gpu is None  # type: ignore[union-attr]
    assert activity_between(before, cpu_sample(1.0, 0.0, gpus=(gpu(util=90, sm=35),))).gpu == (  # type: ignore[union-attr]
        "GPU 0: its processes at 35% SM")
    # without per-process figures the device's utilization stands in
    assert activity_between(before, cpu_sample(1.0, 0.0, gpus=(gpu(util=90),))).gpu == "GPU 0 at 90%"  # type: ignore[union-attr]
    # memory moving counts (its own processes' figure where there is one)
    moved = cpu_sample(1.0, 0.0, gpus=(gpu(used=400 * MIB),))
    assert activity_between(before, moved).gpu == "GPU 0 memory moved 390.0 MiB"  # type: ignore[union-attr]
    steady = cpu_sample(1.0, 0.0, gpus=(gpu(used=10 * MIB + 4096),))
    assert activity_between(before, steady).gpu is None  # type: ignore[union-attr]


def feed(live: Liveness, start: float, end: float, cpu_per_s: float, step: float = 1.0, gpus: tuple = ()) -> None:
    """Samples every ``step`` seconds over [start, end] of a tree using ``cpu_per_s`` of a core."""
    cpu = live.previous.worker_cpu_seconds if live.previous is not None else 0.0
    t = start
    while t < end - 1e-9:
        t = min(end, t + step)
        cpu = (cpu or 0.0) + cpu_per_s * step
        live.add(cpu_sample(t, cpu, gpus=gpus))


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
        live.add(cpu_sample(float(t), None, None))
    judgement = live.judge(quiet=25.0, configured=20.0, steps_known=True, now=30.0)
    assert judgement.hung == "no progress for 25 s (--hang-timeout 20); no CPU figures of its processes"


def test_a_steady_cadence_finds_a_stall_sooner_and_never_cuts_a_slow_steady_job() -> None:
    cadence = Cadence()
    for i in range(20):
        cadence.sign(10.0 * i)  # 19 gaps: not enough yet
    assert cadence.timeout() is None
    for i in range(20, 40):
        cadence.sign(10.0 * i)
    assert cadence.gaps == 39 and cadence.timeout() == progress.CADENCE_FLOOR  # 5 × 10 s is under the floor

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
    assert live.timeout(1800.0, steps_known=False)[0] == progress.CADENCE_FLOOR
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
        watch.observe(cpu_sample(float(t), 0.9 * t))
    judgement = watch.check_hang(last_output=39.0, timeout=10.0, now=39.0)
    assert judgement is not None and judgement.hung is None and judgement.held is not None
    assert judgement.held.startswith("silent 37 s; busy: 90% of a core")
    for t in range(40, 52):  # now stuck
        watch.observe(cpu_sample(float(t), 0.9 * 39))
    judged = watch.check_hang(last_output=51.0, timeout=10.0, now=51.0)
    assert judged is not None and judged.hung is not None
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
    live.add(cpu_sample(101.0, 0.8))  # 0.8 s of CPU since the worker started
    assert live.busy == "80% of a core"
    live2 = Liveness(started=100.0)
    live2.add(replace(cpu_sample(101.0, 0.0), worker_cpu_seconds=0.0))
    assert live2.busy is None and live2.idle is not None and live2.idle.since == 100.0


def test_idle_gpus_do_not_keep_a_hung_worker_alive() -> None:
    live = Liveness(started=0.0)
    feed(live, 0.0, 30.0, cpu_per_s=0.0, gpus=(gpu(util=0, worker=2 << 30, sm=0),))  # memory held, nothing running
    judgement = live.judge(quiet=30.0, configured=20.0, steps_known=True, now=30.0)
    assert judgement.hung is not None and judgement.hung.endswith("0 B of I/O, its GPUs idle")
    assert judgement.figures["gpu"] == "idle"


# --- merged from tests/test_liveness_pins.py ----------------------------------------------------------------
# Liveness (observe/progress.py) pinned where mutation testing (bench/mutation.py) found it loose:
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
    assert [duration(s) for s in (119.0, 120.0, 3000.0, 7199.0, 7200.0, 720000.0)] == [
        "119 s", "2 min", "50 min", "120 min", "2.0 h", "200.0 h"]
    # sizes are units.format_size's, shared with every other figure (it goes on to TiB)
    assert [format_size(n) for n in (1023, 1024, 2048, 3 << 30, 2048 << 30)] == [
        "1023 B", "1.0 KiB", "2.0 KiB", "3.0 GiB", "2.0 TiB"]


def test_no_cadence_is_learned_from_fewer_than_twenty_gaps_however_long_they_span() -> None:
    live = Liveness(0.0)
    for i in range(20):
        live.steps.sign(100.0 * i)  # 19 gaps over 1900 s
    assert live.steps.timeout() is None


def test_the_cadences_span_is_measured_from_its_first_sign_not_from_zero() -> None:
    """The clock is monotonic: a run's first sign comes at any time, here 5000 s after boot. A burst
    of signs spanning less than the floor teaches nothing, however late it started."""
    from oomguard.supervisor.observe import progress

    cadence = progress.Cadence()
    for t in range(progress.CADENCE_GAPS + 1):
        cadence.sign(5000.0 + t)
    assert cadence.gaps >= progress.CADENCE_GAPS and cadence.timeout() is None
    cadence.sign(5000.0 + progress.CADENCE_FLOOR)  # the span reaches the floor: learned
    assert cadence.timeout() == progress.CADENCE_FACTOR * cadence.longest


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
    floor = progress.CADENCE_FLOOR
    cadence = Cadence()
    for t in range(int(floor)):  # a sign a second: 299 gaps spanning 299 s
        cadence.sign(float(t))
    assert cadence.gaps >= progress.CADENCE_GAPS and cadence.timeout() is None
    cadence.sign(floor)  # the span reaches the floor
    assert cadence.timeout() == floor


def test_a_cadence_needs_its_gaps_even_over_a_long_span() -> None:
    cadence = Cadence()
    for i in range(progress.CADENCE_GAPS):  # 19 gaps over 1900 s
        cadence.sign(100.0 * i)
    assert cadence.timeout() is None
    cadence.sign(100.0 * progress.CADENCE_GAPS)
    assert cadence.timeout() == progress.CADENCE_FACTOR * 100.0
