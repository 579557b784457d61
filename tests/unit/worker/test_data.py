"""The sampler that resumes exactly across epochs, and splitting and slicing a batch of any shape
(worker/data.py)."""

from __future__ import annotations

import pytest
import torch

from oomguard.worker import (
    ResumableSampler,
)
from oomguard.worker.data import batch_size, slice_batch, split_sizes


def test_sampler_resumes_exactly_across_epochs() -> None:
    whole = ResumableSampler(10, seed=3)
    expected = whole.take(37)
    first = ResumableSampler(10, seed=3)
    got = first.take(13)
    second = ResumableSampler(10, seed=3)
    second.load_state_dict(first.state_dict())
    got += second.take(24)
    assert got == expected
    assert sorted(expected[:10]) == list(range(10)) and expected[:10] != expected[10:20]
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(10, seed=4).load_state_dict(first.state_dict())
    ranks = [next(ResumableSampler(10, seed=3).batches(8, r, 2)) for r in (0, 1)]
    assert ranks[0] + ranks[1] == expected[:8]


def test_batches_slice_tensors_tuples_dicts_and_lists() -> None:
    batch = {"x": torch.arange(10).view(5, 2), "ids": list("abcde"), "pair": (torch.zeros(5), torch.ones(5))}
    assert batch_size(batch) == 5
    part = slice_batch(batch, 1, 3)
    assert (
        part["x"].tolist() == [[2, 3], [4, 5]] and part["ids"] == ["b", "c"] and part["pair"][1].shape == (2,)
    )


def test_split_covers_everything() -> None:
    assert split_sizes(10, 4) == [4, 4, 2] and split_sizes(8, 8) == [8] and sum(split_sizes(97, 10)) == 97
