"""What the loop learns while an attempt runs (observe/progress.py), pinned where mutation testing
(bench/mutation.py) found it loose: the worker's records, steps read from the output, checkpoints as
progress, the resume check's feed and the cooldown of a checkpoint request."""

from __future__ import annotations

from pathlib import Path

from oomguard.common import protocol
from oomguard.supervisor.observe.checkpoints import ResumeCheck
from oomguard.supervisor.observe.progress import (
    MTIME_SLACK,
    PROGRESS_EVENT_EVERY,
    REQUEST_COOLDOWN,
    STAMP_SLACK,
    AttemptWatch,
    StepSeen,
)
from oomguard.supervisor.observe.sampler import MemorySample


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
