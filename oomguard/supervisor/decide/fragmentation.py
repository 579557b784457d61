"""Is a CUDA OOM fragmentation? Judged from the allocator's own figures in the OOM message.

PyTorch's message says how much was requested, how much the process may use ("total capacity of
X" or, under a per-process memory fraction, "X allowed") and how much is "reserved by PyTorch but
unallocated": cached blocks the request did not fit into. ``expandable_segments:True`` lets the
allocator reuse that memory, so retrying at the same micro-batch can only help when it is a large
share of what the process may use. On an 80 GB H100 three real OOMs showed 1.2-2.1 GiB (2-5%)
unallocated for 0.75-1 GiB requests: a retry at the same size failed each time, because the step
needed far more than those few GiB. Pure: the loop hands it the scanner's numbers, or, where the
in-process probe caught the OOM, the allocator's own (``at_oom``): reserved minus allocated at that
moment, against the request and the limit the allocator may reach; those come first.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.supervisor.observe.allocator import AllocatorOom
from oomguard.supervisor.units import format_size

# Reserved-but-unallocated memory at or above this share of the memory the process may use is what
# blocked the allocation: 16 GiB of 79 GiB is (a defragmented allocator gets that much back);
# 2 GiB of 79 GiB is not (halving the micro-batch frees tens of GiB, which the step needs).
SHARE = 0.10


@dataclass(frozen=True)
class Judgement:
    fragmented: bool
    why: str


def judge(tried: int | None, reserved_unallocated: int | None, capacity: int | None,
          predicted_peak: float | None = None) -> Judgement:
    """Fragmentation or not, and why. ``predicted_peak`` is the memory model's peak for the failed
    micro-batch (from measured peaks per sample), where it has one."""
    if tried is None or reserved_unallocated is None:
        return Judgement(False, "the OOM message has no allocator figures")
    if reserved_unallocated <= tried:
        return Judgement(False, f"only {format_size(reserved_unallocated)} reserved but unallocated for a "
                         f"{format_size(tried)} request")
    if capacity is None:
        return Judgement(False, "the OOM message does not say how much memory the process may use")
    if predicted_peak is not None and predicted_peak > capacity:
        # The measured peak per sample says this micro-batch needs more than exists: no allocator
        # setting can make it fit.
        return Judgement(False, f"the memory model predicts a {format_size(predicted_peak)} peak at this "
                         f"micro-batch, above the {format_size(capacity)} available")
    share = reserved_unallocated / capacity
    figures = (f"{format_size(reserved_unallocated)} reserved but unallocated, {share:.0%} of the "
               f"{format_size(capacity)} it may use")
    if share >= SHARE:
        return Judgement(True, f"fragmentation: {figures}")
    return Judgement(False, f"not fragmentation: {figures} (below {SHARE:.0%})")


def at_oom(allocator: AllocatorOom | None, tried: int | None, reserved_unallocated: int | None,
           capacity: int | None, predicted_peak: float | None = None) -> Judgement:
    """Fragmentation judged from the probe's figures at the OOM where it has them (reserved minus
    allocated, the request, the allocator's limit), else from the OOM message's."""
    if allocator is None or allocator.requested is None or allocator.reserved_unallocated is None:
        return judge(tried, reserved_unallocated, capacity, predicted_peak)
    found = judge(allocator.requested, allocator.reserved_unallocated, allocator.limit or capacity, predicted_peak)
    return Judgement(found.fragmented, f"{found.why} (the allocator's figures at the OOM)")
