"""The forecast's budgets, its words for a duration and its moves at their edges (docs/mutation.md:
the survivors these pin). The rate of an earlier attempt is used where a test needs an exact time
to the limit: (limit - used) / rate."""

from __future__ import annotations

import pytest

from oomguard.supervisor.observe.cgroup import CgroupMemory
from oomguard.supervisor.observe.gpu import GpuReading
from oomguard.supervisor.observe.sampler import MemorySample
from oomguard.supervisor.sizing.trend import Budget, Forecast, Move, Reading, budgets, forecast

GIB = 2**30
EARLY = [Reading(0.0, 0, 0)]  # too few readings for a line of this attempt's own


def gpu(index: int, used: int, total: int = 80 * GIB) -> GpuReading:
    return GpuReading(index, index, f"GPU-{index}", "H100", total, used, total - used, 0, None, ())


def test_every_limit_that_applies_with_the_memory_counted_against_it() -> None:
    cgroup = CgroupMemory("/cg", 2, 9 * GIB, 7 * GIB, 16 * GIB, 0, 8 * GIB)
    sample = MemorySample(0.0, 0.0, 1, 3 * GIB, (1,), 64 * GIB, 32 * GIB, cgroup, None,
                          (gpu(0, 10 * GIB), gpu(1, 30 * GIB, 40 * GIB), gpu(2, 20 * GIB)))
    assert budgets(sample, 12 * GIB, 0.5, allocator=(5 * GIB, 24 * GIB)) == [
        Budget("allocator", 5 * GIB, 12 * GIB, 24 * GIB),
        Budget("GPU", 30 * GIB, 20 * GIB, 40 * GIB),  # the busiest device
        Budget("--memory-limit", 3 * GIB, 6 * GIB, 12 * GIB),
        Budget("cgroup", 8 * GIB, 8 * GIB, 16 * GIB)]
    gone = MemorySample(0.0, 0.0, None, None, (), 64 * GIB, 32 * GIB, None, None)
    assert budgets(gone, 12 * GIB, 0.5) == []  # no worker: nothing counted against --memory-limit


@pytest.mark.parametrize(("seconds", "words"), [
    (89.0, "89 s"), (90.0, "2 min"), (5399.0, "90 min"), (5400.0, "1.5 h"), (9000.0, "2.5 h")])
def test_durations_in_words(seconds: float, words: str) -> None:
    assert Forecast(seconds, 2e6, "cgroup", GIB, Move.WATCH, True).text == (
        f"cgroup limit in ~{words} at this rate (+2.0 MB/s)")


def test_an_earlier_attempts_rate_of_one_byte_a_second_still_forecasts() -> None:
    found = forecast(EARLY, Budget("cgroup", 1000, 1600), None, None, prior_per_s=1.0)
    assert found is not None and found.seconds_to_limit == 600.0 and not found.measured
    assert forecast(EARLY, Budget("cgroup", 1000, 1600), None, None, prior_per_s=0.0) is None
    past = forecast(EARLY, Budget("cgroup", 2000, 1600), None, None, prior_per_s=1.0)
    assert past is not None and past.seconds_to_limit == 0.0


def test_without_a_checkpoint_rhythm_a_checkpoint_is_due_within_twice_the_margin() -> None:
    """The margin is 3 s + 15 % of the time left: at 8 s left twice it is 8.4 s, at 12 s 9.6 s."""
    soon = forecast(EARLY, Budget("cgroup", 0, 800), None, None, prior_per_s=100.0)
    assert soon is not None and soon.move is Move.CHECKPOINT_NOW
    later = forecast(EARLY, Budget("cgroup", 0, 1200), None, None, prior_per_s=100.0)
    assert later is not None and later.move is Move.WATCH
    # the next checkpoint known but not the period between them: still no rhythm to plan by
    known = forecast(EARLY, Budget("cgroup", 0, 1200), 5.0, None, prior_per_s=100.0)
    assert known is not None and known.move is Move.WATCH


def test_each_move_holds_at_its_boundary() -> None:
    """20 s left, so the margin is 3 s + 15 % of 20 s = 6 s exactly: a checkpoint due in 14 s is
    now (14 + 6 = 20); one due in 4 s with 10 s between checkpoints is a restart at the next (4 +
    10 + 6 = 20). Without a rhythm, 6000 bytes at 700 B/s leave exactly twice the margin."""
    twenty = Budget("cgroup", 0, 2000)
    now = forecast(EARLY, twenty, 14.0, 100.0, prior_per_s=100.0)
    assert now is not None and now.seconds_to_limit == 20.0 and now.move is Move.CHECKPOINT_NOW
    at_next = forecast(EARLY, twenty, 4.0, 10.0, prior_per_s=100.0)
    assert at_next is not None and at_next.move is Move.RESTART_AT_NEXT
    edge = forecast(EARLY, Budget("cgroup", 0, 6000), None, None, prior_per_s=700.0)
    assert edge is not None and edge.move is Move.CHECKPOINT_NOW


def test_hours_are_shown_to_a_tenth() -> None:
    assert Forecast(5580.0, 2e6, "GPU", GIB, Move.WATCH, True).text.startswith("GPU limit in ~1.6 h ")
