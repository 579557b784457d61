"""Each verdict of the fragmentation judgement with its reason word for word, at its boundaries,
and which figures it is judged from: the probe's at the OOM, else the OOM message's
(docs/mutation.md: the survivors these pin)."""

from __future__ import annotations

from oomguard.supervisor.decide.classify import Judgement, at_oom, judge
from oomguard.supervisor.observe.allocator import AllocatorOom

GIB = 2**30
NO_FIGURES = Judgement(False, "the OOM message has no allocator figures")
TEN_PERCENT = "8.0 GiB reserved but unallocated = 10% of 80.0 GiB"
FRAGMENTED = Judgement(True, f"fragmentation: {TEN_PERCENT}")


def test_without_the_request_or_the_unallocated_figure_there_is_no_judgement() -> None:
    assert judge(None, 5 * GIB, 80 * GIB) == NO_FIGURES
    assert judge(1 * GIB, None, 80 * GIB) == NO_FIGURES


def test_unallocated_memory_no_larger_than_the_request_cannot_be_what_blocked_it() -> None:
    assert judge(2 * GIB, 2 * GIB, 80 * GIB) == Judgement(
        False, "only 2.0 GiB reserved but unallocated for a 2.0 GiB request")


def test_without_the_capacity_no_share_can_be_judged() -> None:
    assert judge(1 * GIB, 8 * GIB, None) == Judgement(
        False, "the OOM message does not say how much memory the process may use")


def test_a_predicted_peak_at_the_capacity_still_fits_one_above_it_does_not() -> None:
    assert judge(1 * GIB, 8 * GIB, 80 * GIB, predicted_peak=80 * GIB) == FRAGMENTED
    assert judge(1 * GIB, 8 * GIB, 80 * GIB, predicted_peak=81 * GIB) == Judgement(
        False, "the memory model predicts a 81.0 GiB peak at this micro-batch, above the 80.0 GiB available")


def test_ten_percent_unallocated_is_fragmentation_nine_is_not() -> None:
    assert judge(1 * GIB, 8 * GIB, 80 * GIB) == FRAGMENTED
    assert judge(1 * GIB, 7 * GIB, 80 * GIB) == Judgement(
        False, "not fragmentation: 7.0 GiB reserved but unallocated = 9% of 80.0 GiB (below 10%)")


def test_the_probes_figures_come_first_with_its_own_limit() -> None:
    """The message said 1 GiB unallocated of a 40 GiB cap; the allocator saw 8 GiB of its 80 GiB."""
    probe = AllocatorOom("cuda:0", 1 * GIB, 62 * GIB, 70 * GIB, None, 80 * GIB, None)
    assert at_oom(probe, 2 * GIB, 1 * GIB, 40 * GIB) == Judgement(
        True, f"fragmentation: {TEN_PERCENT} (the allocator's figures at the OOM)")
    assert at_oom(probe, 2 * GIB, 1 * GIB, 40 * GIB, predicted_peak=90 * GIB) == Judgement(
        False, "the memory model predicts a 90.0 GiB peak at this micro-batch, above the 80.0 GiB available "
        "(the allocator's figures at the OOM)")
    no_total = AllocatorOom("cuda:0", 1 * GIB, 62 * GIB, 70 * GIB, None, None, None)
    assert at_oom(no_total, 2 * GIB, 1 * GIB, 40 * GIB) == Judgement(
        True, "fragmentation: 8.0 GiB reserved but unallocated = 20% of 40.0 GiB (the allocator's figures at the OOM)")


def test_a_probe_record_missing_a_figure_leaves_the_judgement_to_the_message() -> None:
    no_request = AllocatorOom("cuda:0", None, 62 * GIB, 70 * GIB, None, 80 * GIB, None)
    no_allocated = AllocatorOom("cuda:0", 1 * GIB, None, 70 * GIB, None, 80 * GIB, None)
    for probe in (None, no_request, no_allocated):
        assert at_oom(probe, 1 * GIB, 8 * GIB, 80 * GIB) == FRAGMENTED
        assert at_oom(probe, 1 * GIB, 8 * GIB, 80 * GIB, predicted_peak=90 * GIB) == Judgement(
            False, "the memory model predicts a 90.0 GiB peak at this micro-batch, above the 80.0 GiB available")
        assert at_oom(probe, 1 * GIB, 8 * GIB, 160 * GIB) == Judgement(
            False, "not fragmentation: 8.0 GiB reserved but unallocated = 5% of 160.0 GiB (below 10%)")
