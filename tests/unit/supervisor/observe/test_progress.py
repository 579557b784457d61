"""What the loop learns while an attempt runs (observe/progress.py), pinned where mutation testing
(bench/mutation.py) found it loose: the worker's records, steps read from the output, checkpoints as
progress, the resume check's feed and the cooldown of a checkpoint request."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from oomguard.supervisor.decide.attribution import Cause, Evidence, Limit, Plateau, attribute, step_peaks
from oomguard.supervisor.decide.fragmentation import at_oom
from oomguard.supervisor.decide.trend import Reading
from oomguard.supervisor.decide.tuning import SizeTuner
from oomguard.supervisor.observe.allocator import AllocatorOom, AllocatorReport
from oomguard.supervisor.observe.memory import MemorySample
from oomguard.supervisor.observe.progress import (
    MTIME_SLACK,
    PROGRESS_EVENT_EVERY,
    REQUEST_COOLDOWN,
    STAMP_SLACK,
    AttemptWatch,
)
from oomguard.supervisor.observe.resume import ResumeCheck
from oomguard.supervisor.observe.steps import StepSeen
from oomguard.supervisor.record.figures import progress_text
from oomguard.worker import protocol


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
    assert w.hang_reason(0.0, 0.5, 10.0) is not None
    assert w.hang_reason(0.0, 0, 10.0) is None


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
    from oomguard.supervisor.observe.memory import MemorySample
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
