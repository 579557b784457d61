"""Fragmentation is judged from the allocator's figures: the three real H100 OOMs where a retry at
the same size failed are not fragmentation; a large share of unusable reserved memory is."""

from __future__ import annotations

import pytest

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.classify import FailureKind, judge
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.observe.output import OutputScanner

GiB = 2**30
# The real texts, from nanoGPT on an 80 GB H100 (alone and via torchrun) and two DDP ranks capped
# with a per-process memory fraction.
NANOGPT = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has a total "
           "capacity of 79.18 GiB of which 56.19 MiB is free. Including non-PyTorch memory, this process has "
           "79.11 GiB memory in use. Of the allocated memory 76.39 GiB is allocated by PyTorch, and 2.06 GiB "
           "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
TORCHRUN = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has a total "
            "capacity of 79.18 GiB of which 374.19 MiB is free. Including non-PyTorch memory, this process "
            "has 78.80 GiB memory in use. Of the allocated memory 75.96 GiB is allocated by PyTorch, and "
            "1.62 GiB is reserved by PyTorch but unallocated.")
DDP_CAPPED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total "
              "capacity of 79.18 GiB of which 31.02 GiB is free. Including non-PyTorch memory, this process "
              "has 23.40 GiB memory in use. Process 8812 has 23.40 GiB memory in use. 23.75 GiB allowed; Of "
              "the allocated memory 22.06 GiB is allocated by PyTorch, and 1.19 GiB is reserved by PyTorch "
              "but unallocated.")
FRAGMENTED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total "
              "capacity of 79.18 GiB of which 200.00 MiB is free. Of the allocated memory 62.00 GiB is "
              "allocated by PyTorch, and 16.00 GiB is reserved by PyTorch but unallocated.")


def _failure(text: str, micro: int = 512, predicted: float | None = None) -> Failure:
    scan = OutputScanner()
    scan.feed(text)
    verdict = judge(scan.tried_bytes, scan.reserved_unallocated, scan.capacity_bytes, predicted)
    return Failure(1, FailureKind.CUDA_OOM, micro, text, verdict.fragmented)


@pytest.mark.parametrize("text", [NANOGPT, TORCHRUN, DDP_CAPPED])
def test_a_few_gib_unallocated_is_not_fragmentation_halve_and_set_expandable(text: str) -> None:
    plan = Plan(BatchPlan(512, 1024, 1))
    d = decide(_failure(text), [], plan, PolicyConfig())
    assert d.action is Action.RESTART
    assert d.plan.batch.micro_batch == 256 and d.plan.batch.grad_accum == 4  # global batch exact
    assert d.plan.expandable_segments  # set in the same restart, no attempt spent on it alone
    assert "expandable_segments:True" in d.reason


def test_scanner_reads_the_allowed_cap_before_the_device_capacity() -> None:
    scan = OutputScanner()
    scan.feed(DDP_CAPPED)
    assert scan.capacity_bytes == int(23.75 * GiB) and scan.reserved_unallocated == int(1.19 * GiB)
    assert scan.allowed_bytes == int(23.75 * GiB)  # a per-process cap NVML cannot see: the limit that applied
    whole = OutputScanner()
    whole.feed(TORCHRUN)
    assert whole.capacity_bytes == int(79.18 * GiB) and whole.allowed_bytes is None
    assert "5%" in judge(scan.tried_bytes, scan.reserved_unallocated, scan.capacity_bytes).why


def test_a_large_share_unallocated_is_fragmentation_same_size_first() -> None:
    plan = Plan(BatchPlan(512, 1024, 1))
    d = decide(_failure(FRAGMENTED), [], plan, PolicyConfig())
    assert d.plan.batch.micro_batch == 512 and d.plan.expandable_segments
    # and if it fails again with the option set, the batch halves
    d2 = decide(_failure(FRAGMENTED), [_failure(FRAGMENTED)], d.plan, PolicyConfig())
    assert d2.plan.batch.micro_batch == 256


def test_the_memory_model_vetoes_a_retry_it_predicts_cannot_fit() -> None:
    assert _failure(FRAGMENTED).fragmented
    assert not _failure(FRAGMENTED, predicted=90 * GiB).fragmented  # measured peaks: 512 needs 90 GiB
    assert _failure(FRAGMENTED, predicted=70 * GiB).fragmented


def test_no_figures_no_fragmentation() -> None:
    assert not judge(None, None, None).fragmented
    assert not judge(GiB, 2 * GiB, None).fragmented  # no capacity in the text: cannot be judged large


def test_at_the_floor_expandable_segments_is_tried_before_giving_up() -> None:
    plan = Plan(BatchPlan(1, 8, 1))
    d = decide(_failure(NANOGPT, micro=1), [], plan, PolicyConfig())
    assert d.action is Action.RESTART and d.plan.expandable_segments and d.plan.batch.micro_batch == 1
    d2 = decide(_failure(NANOGPT, micro=1), [], d.plan, PolicyConfig())
    assert d2.action is Action.GIVE_UP
