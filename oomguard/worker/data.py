"""Global batches in, micro-batches out: slicing a batch along its first dimension, and drawing
per-step batches from a map-style dataset through the resumable sampler."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from oomguard.worker.sampler import ResumableSampler


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (or length of its first list)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return batch_size(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        if batch and isinstance(batch[0], (torch.Tensor, Mapping, tuple)):
            return batch_size(batch[0])
        return len(batch)
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}; use tensors, tuples or dicts")


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of every tensor (or list) in ``batch``, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return {k: slice_batch(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(slice_batch(v, start, stop) for v in batch)
    if isinstance(batch, list):
        if batch and isinstance(batch[0], (torch.Tensor, Mapping, tuple)):
            return [slice_batch(v, start, stop) for v in batch]
        return batch[start:stop]
    raise TypeError(f"cannot slice a {type(batch).__name__}; use tensors, tuples or dicts")


def draw(
    dataset: Dataset[Any],
    sampler: ResumableSampler,
    global_batch: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
) -> Iterator[Any]:
    """Endless collated per-step batches (this rank's share of each global batch)."""
    loader = DataLoader(
        dataset,
        batch_sampler=sampler.batches(global_batch, rank, world_size),
        collate_fn=collate_fn or default_collate,
        num_workers=num_workers,
        # Its own generator: a DataLoader iterator draws a seed from the global torch RNG when it
        # starts, which would shift the model's random stream (dropout) after every resume.
        generator=torch.Generator().manual_seed(sampler.seed),
    )
    yield from loader
