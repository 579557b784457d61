"""The progress the in-process probe's step records make (docs/mutation.md: the survivors these pin):
when each step happened by the record's own clock, the ETA, the resume check's feed, and one record
being enough to make steps known."""

from __future__ import annotations

from test_probe_figures import oom_record, step_record

from oomguard.common import protocol
from oomguard.supervisor.observe.checkpoints import ResumeCheck
from oomguard.supervisor.observe.progress import AttemptWatch


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
