"""The cause line and its figures, word for word: what the journal, status --json, the report and
the notification show of a memory failure (docs/mutation.md: the survivors these pin).

Scripted series from tests/test_explains.py against a 400 MiB cgroup; every figure below was
checked by hand against its series (a 1 MiB-a-step creep at 10 steps a second, a noisy one, a
plateau), so a change in any rounding, key or clause shows here.
"""

from __future__ import annotations

import pytest
from test_attribution import plateau_series
from test_explains import LIMIT, MIB, cgroup, creep, then

from oomguard.supervisor.decide.attribution import Cause, Evidence, Plateau, attribute, step_peaks
from oomguard.supervisor.observe.allocator import AllocatorOom
from oomguard.supervisor.sizing.memmodel import Fit
from oomguard.supervisor.sizing.trend import Reading

CREEP = creep(n=18, every=1.0, steps_per_s=10, per_step=1 * MIB)  # 100 MiB + 1 MiB a step, 10 steps a second
GIB = 2**30
SHORT = creep(n=7, every=1.0, steps_per_s=10, per_step=1 * MIB)  # the same creep, failed after 60 steps
TREND = {"bytes_per_s": 10485760, "bytes_per_step": 1048576, "r2": 1.0, "span_s": 16.0, "samples": 17, "steps": 160}
SHORT_TREND = {**TREND, "samples": 6, "span_s": 5.0, "steps": 50}
SHORT_ROOM = {"budget": "cgroup", "limit_bytes": LIMIT, "trend_at_failure_bytes": 160 * MIB,
              "below_limit_bytes": 240 * MIB, "tolerance_bytes": 8 * MIB, "noise_bytes": 0, "rise_bytes": 50 * MIB,
              "seconds_to_limit": 24.0, "steps_to_limit": 240, "jump_bytes": None}
SHORT_ROOM_WORDS = ("at the failure the cgroup trend line was at 160 MiB, 240 MiB short of the 400 MiB limit "
                    "(~240 steps at this rate; within 8 MiB counts as reaching it), so the memory that reached it "
                    "came between two readings")


def test_a_spike_on_a_noisy_creep_is_told_with_every_figure_rounded_as_shown() -> None:
    """Readings every 0.73 s with 3 MiB of noise, then one 300 MiB reading: the jump, not the
    line, reached the limit. No failure time is known, so the failure is at the last reading."""
    series = then(creep(n=18, every=0.73, steps_per_s=10, per_step=1 * MIB, noise=3 * MIB, seed=3), 300 * MIB,
                  every=0.73)
    found = attribute(series, Evidence(), 16, limit=cgroup(series))
    assert found.as_dict() == {
        "cause": "per_sample",
        "summary": "per-sample, by elimination: a spike on a steady rise (worker RSS grew 1.1 MB/step, 10.6 MB/s "
                   "(R² 1.00 over 17 samples, 12 s)), at least 300 MiB at micro-batch 16 (the highest reading before "
                   "the failure: a lower bound); at the failure the cgroup trend line was at 232 MiB, 168 MiB short of "
                   "the 400 MiB limit (~166 steps at this rate; within 8 MiB counts as reaching it), and memory "
                   "jumped 68 MiB above it; the trend rose only 126 MiB in this attempt, less than the 168 MiB the "
                   "jump needed beyond it, so the jump, not the rise, reached the limit; only micro-batch 16 measured "
                   "so far",
        "bytes_per_s": 10616167, "bytes_per_step": 1061239, "r2": 0.998, "samples": 17, "span_s": 11.7,
        "steps": 117, "budget": "cgroup", "limit_bytes": LIMIT, "trend_at_failure_bytes": 243056234,
        "below_limit_bytes": 176374166, "tolerance_bytes": 8 * MIB, "noise_bytes": 2017789,
        "rise_bytes": 131746629, "seconds_to_limit": 16.6, "steps_to_limit": 166, "jump_bytes": 71516564,
        "plateau_bytes": 300 * MIB, "plateau_censored": True}


def test_a_leak_that_added_the_room_the_jump_needed_names_the_jump_and_the_phase() -> None:
    series = then(CREEP, 300 * MIB)
    found = attribute(series, Evidence(frames=("main", "evaluate")), 16, limit=cgroup(series))
    assert found.cause is Cause.LEAK and found.also is Cause.EVALUATION
    assert found.summary == (
        "leak and a spike: worker RSS grew 1.0 MB/step, 10.5 MB/s (R² 1.00 over 17 samples, 16 s) at micro-batch "
        "16; at the failure the cgroup trend line was at 280 MiB, 120 MiB short of the 400 MiB limit (~120 steps at "
        "this rate; within 8 MiB counts as reaching it), and memory jumped above the trend (a reading saw 20 MiB above "
        "the trend); it failed in evaluation (traceback through evaluate()); the leak added 170 MiB in this "
        "attempt, at least the 120 MiB the jump needed beyond the trend, so a fresh restart at the same size has "
        "room for the spike")
    assert found.figures == {**TREND, "budget": "cgroup", "limit_bytes": LIMIT, "trend_at_failure_bytes": 280 * MIB,
                             "below_limit_bytes": 120 * MIB, "tolerance_bytes": 8 * MIB, "noise_bytes": 0,
                             "rise_bytes": 170 * MIB, "seconds_to_limit": 12.0, "steps_to_limit": 120,
                             "jump_bytes": 20 * MIB}
    assert found.as_dict()["also"] == "evaluation"


def test_a_leak_and_a_spike_no_reading_saw_in_no_phase() -> None:
    found = attribute(CREEP, Evidence(), 16, limit=cgroup(CREEP, failed_at=CREEP[-1].t + 0.5))
    assert found.cause is Cause.LEAK and found.also is Cause.PER_SAMPLE
    assert found.summary == (
        "leak and a spike: worker RSS grew 1.0 MB/step, 10.5 MB/s (R² 1.00 over 17 samples, 16 s) at micro-batch "
        "16; at the failure the cgroup trend line was at 275 MiB, 125 MiB short of the 400 MiB limit (~125 steps at "
        "this rate; within 8 MiB counts as reaching it), and memory jumped above the trend; the leak added 165 MiB in "
        "this attempt, at least the 125 MiB the jump needed beyond the trend, so a fresh restart at the same size "
        "has room for the spike")
    assert found.figures["seconds_to_limit"] == 12.5 and found.figures["jump_bytes"] is None


def test_a_dead_dataloader_worker_is_quoted_without_its_full_stop_beside_the_room() -> None:
    found = attribute(SHORT, Evidence(dataloader=" DataLoader worker (pid 12) is killed by signal: Killed. "), 16,
                      limit=cgroup(SHORT))
    line = "DataLoader worker (pid 12) is killed by signal: Killed"
    assert found.as_dict() == {"cause": "data_loader",
                               "summary": f"a DataLoader worker died ({line}); {SHORT_ROOM_WORDS}",
                               **SHORT_TREND, **SHORT_ROOM, "evidence": line}


def test_a_phase_spike_keeps_its_evidence_and_says_the_rise_was_too_small() -> None:
    found = attribute(SHORT, Evidence(tail=("Saving model checkpoint to out",)), 16, limit=cgroup(SHORT))
    assert found.as_dict() == {
        "cause": "checkpoint_saving",
        "summary": f"checkpoint saving-time spike (last output: Saving model checkpoint to out); {SHORT_ROOM_WORDS}; "
                   "the trend rose only 50 MiB in this attempt, less than the 240 MiB the jump needed beyond it, so "
                   "the jump, not the rise, reached the limit",
        **SHORT_TREND, **SHORT_ROOM, "evidence": "last output: Saving model checkpoint to out"}


def test_without_a_limit_the_memory_named_and_the_micro_batch_are_in_the_line() -> None:
    assert attribute(creep(), Evidence(), 16, "GPU memory").summary == (
        "leak: GPU memory grew 0.5 MB/step, 1.8 MB/s (R² 1.00 over 29 samples, 28 s) at micro-batch 16")
    found = attribute(then(creep(), 300 * MIB), Evidence(), 16, "GPU memory")
    assert found.summary == (
        "per-sample, by elimination: a spike on a steady rise (GPU memory grew 0.5 MB/step, 1.8 MB/s (R² 1.00 over "
        "29 samples, 28 s)), at least 300 MiB at micro-batch 16 (the highest reading before the failure: a lower "
        "bound); only micro-batch 16 measured so far")


def test_too_few_readings_or_no_rise_say_so_with_the_plateau() -> None:
    assert attribute(SHORT[:3], Evidence(), 16).summary == (
        "per-sample, by elimination: too few samples after warm-up to see a trend, at least 120 MiB at micro-batch "
        "16 (the highest reading before the failure: a lower bound); only micro-batch 16 measured so far")
    level = attribute(plateau_series(), Evidence(), 16, "GPU memory", failed=False)
    assert level.summary == ("per-sample, by elimination: no steady rise after warm-up (slope 1.1 MB/s, R² 0.10), "
                             "plateau 768 MiB at micro-batch 16; only micro-batch 16 measured so far")
    assert level.figures["plateau_bytes"] == 804957035 and level.figures["plateau_censored"] is False
    model = attribute(plateau_series(), Evidence(), 16, "GPU memory", model=Fit(200 * MIB, 3.25 * MIB, 2))
    assert model.summary.endswith("; the memory model measured 3.2 MiB a sample; memory follows the micro-batch")
    assert model.figures["per_sample_bytes"] == 3407872


def measured(*plateaus: tuple[int, int]) -> list[Plateau]:
    return [Plateau(micro, size, False) for micro, size in plateaus]


def test_memory_follows_only_beyond_the_margin() -> None:
    """5 % more at twice the batch is jitter, not memory following the batch."""
    smallest = 400 * MIB
    at_margin = int(smallest * 1.05)
    assert at_margin == smallest * 1.05  # exactly on the margin: not above it
    found = attribute((), Evidence(), 32, earlier=measured((64, at_margin), (32, smallest)), failed=False)
    assert found.figures["follows"] is False and found.figures["plateaus"] == {"64": at_margin, "32": smallest}
    assert attribute((), Evidence(), 32, earlier=measured((64, at_margin + 1), (32, smallest)),
                     failed=False).figures["follows"] is True


def test_level_plateaus_stay_level_measured_from_the_largest_to_the_smallest_batch() -> None:
    found = attribute((), Evidence(), 32, earlier=measured((128, 400 * MIB), (64, 300 * MIB), (32, 400 * MIB)),
                      failed=False)
    assert found.figures["follows"] is False
    assert found.summary.endswith("but memory does not follow the micro-batch: its plateaus stayed level as the "
                                  "micro-batch shrank (400 MiB at 128, 300 MiB at 64, 400 MiB at 32)")
    assert found.figures["plateaus"] == {"128": 400 * MIB, "64": 300 * MIB, "32": 400 * MIB}


def test_a_jump_larger_than_the_room_left_needs_more_than_the_leak_gave_back() -> None:
    """The line was 140 MiB below the limit and had risen 150 MiB, but a reading saw memory 220 MiB
    above it: the jump needed 220 MiB, more than a fresh restart gives back, so the batch shrinks."""
    series = then(SHORT, 390 * MIB)
    found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=16.0))
    f = found.figures
    assert (f["rise_bytes"], f["below_limit_bytes"], f["jump_bytes"]) == (150 * MIB, 140 * MIB, 220 * MIB)
    assert found.cause is Cause.PER_SAMPLE and found.also is None
    assert ("; the trend rose only 150 MiB in this attempt, less than the 220 MiB the jump needed beyond it, so the "
            "jump, not the rise, reached the limit") in found.summary


def test_a_leak_that_gave_back_exactly_what_the_jump_needed_is_enough() -> None:
    series = then(SHORT, 390 * MIB)
    at_equal = 22.999999999999996  # found by bisection: the line's rise equals the jump's height here
    found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=at_equal))
    assert found.figures["rise_bytes"] == found.figures["jump_bytes"] == 220 * MIB
    assert found.cause is Cause.LEAK and found.also is Cause.PER_SAMPLE


def test_the_allocators_figures_and_the_slope_of_the_other_sizes_peaks() -> None:
    """The probe caught the OOM at 256 under a 0.9 memory fraction of an 80 GiB device; its step
    peaks measured 31 GiB at 128 and 16 GiB at 64 (15 GiB for 64 samples: 240 MiB each). The peak
    at the failing size itself and an empty one (0) measure nothing."""
    alloc = AllocatorOom("cuda:0", 1 * GIB, 70 * GIB, 74 * GIB, 1 * GIB, 80 * GIB, 0.9, 120, None)
    peaks = {256: 60 * GIB, 128: 31 * GIB, 64: 16 * GIB, 32: 0}
    found = attribute((), Evidence(allocator=alloc, step_peaks=peaks), 256, "GPU memory")
    assert found.as_dict() == {
        "cause": "per_sample",
        "summary": "per-sample: needed 1.0 GiB more with 70.0 GiB allocated of 72.0 GiB (90% of the device) at "
                   "micro-batch 256 (4.0 GiB reserved but unallocated); 240.0 MiB per sample measured at 128 and 64",
        "source": "allocator", "requested_bytes": 1 * GIB, "allocated_bytes": 70 * GIB, "reserved_bytes": 74 * GIB,
        "limit_bytes": 72 * GIB, "fraction": 0.9, "per_sample_bytes": 240 * MIB, "measured_at": [128, 64]}


def test_the_allocators_own_micro_batch_wins_and_missing_figures_are_left_out() -> None:
    bare = AllocatorOom("cuda:0", None, None, None, None, None, None, None, 512)
    found = attribute((), Evidence(allocator=bare, step_peaks={512: 90 * GIB, 256: 20 * GIB}), 128, "GPU memory")
    assert found.summary == ("per-sample: an allocation failed at micro-batch 512; at most 80.0 MiB per sample "
                             "measured at 256")
    unbounded = AllocatorOom("cuda:0", 2 * GIB, 70 * GIB, 70 * GIB, None, None, None, None, None)
    assert attribute((), Evidence(allocator=unbounded), 64, "GPU memory").summary == (
        "per-sample: needed 2.0 GiB more with 70.0 GiB allocated at micro-batch 64")


def test_readings_that_saw_nothing_are_named_as_such() -> None:
    found = attribute([Reading(float(i), 0, i) for i in range(5)], Evidence(), 16, "GPU memory")
    assert found.as_dict() == {
        "cause": "per_sample", "unseen": "GPU memory",
        "summary": "per-sample, by elimination: too few samples after warm-up to see a trend; the GPU memory readings "
                   "saw none of its memory (all 0); only micro-batch 16 measured so far"}


@pytest.mark.parametrize(("this_failed", "earlier_failed", "bounds"), [
    (True, False, "400 MiB at 64, at least 300 MiB at 32"),
    (False, True, "at least 400 MiB at 64, 300 MiB at 32"),
])
def test_each_lower_bound_is_marked_and_only_it(this_failed: bool, earlier_failed: bool, bounds: str) -> None:
    found = attribute([Reading(float(i), 300 * MIB, i) for i in range(3)], Evidence(), 32,
                      earlier=[Plateau(64, 400 * MIB, earlier_failed)], failed=this_failed)
    assert found.summary.endswith(f"; the readings before a memory failure are lower bounds ({bounds}), so they "
                                  "cannot tell how memory scales with the micro-batch")
    assert found.figures["follows"] is None and found.figures["plateaus"] == {"64": 400 * MIB, "32": 300 * MIB}


def test_the_peak_of_each_size_is_its_highest_over_the_attempts() -> None:
    rows = [{"micro_batch": 32, "peak_allocated": 4 * GIB}, {"micro_batch": 16, "peak_allocated": 1 * GIB},
            {"micro_batch": 32, "peak_allocated": 3 * GIB}, {"micro_batch": 8}]
    assert step_peaks(rows) == {32: 4 * GIB, 16: 1 * GIB}


def test_memory_that_falls_never_reaches_the_limit_in_seconds_or_steps() -> None:
    """Freed memory (0.5 MiB a step less): no time or step count to the limit, null in the JSON."""
    falling = creep(n=20, every=1.0, steps_per_s=10, base=300 * MIB, per_step=-0.5 * MIB)
    found = attribute(falling, Evidence(), 16, limit=cgroup(falling))
    assert found.figures["seconds_to_limit"] is None and found.figures["steps_to_limit"] is None
    assert "195 MiB short of the 400 MiB limit (within 8 MiB counts as reaching it)" in found.summary
