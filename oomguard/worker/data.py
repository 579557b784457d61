"""Global batches in, micro-batches out: splitting a batch along its first dimension, and drawing
per-step batches from a map-style dataset through the resumable sampler.

Also here:

- A deterministic sampler that can stop and resume at any sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

# A deterministic sampler that can stop and resume at any sample.
#
# The order depends only on (seed, epoch): each epoch is a permutation drawn from its own
# generator, so the position in samples is the whole state. Resuming at position p yields exactly
# what an uninterrupted run yields from p on, whatever the micro-batch.


class ResumableSampler(Sampler[int]):
    """Indices of a map-style dataset of ``num_samples``, epoch after epoch, from ``position``."""

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True, position: int = 0) -> None:
        if num_samples <= 0:
            raise ValueError(f"ResumableSampler needs a non-empty dataset, got num_samples={num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.position = position
        self._epoch_cache: tuple[int, list[int]] | None = None

    @property
    def epoch(self) -> int:
        return self.position // self.num_samples

    def take(self, count: int) -> list[int]:
        """The next ``count`` indices (crossing epoch boundaries), advancing the position."""
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(self.position, self.num_samples)
            chunk = self._order(epoch)[offset : offset + count - len(out)]
            out.extend(chunk)
            self.position += len(chunk)
        return out

    def batches(self, global_batch: int, rank: int = 0, world_size: int = 1) -> Iterator[list[int]]:
        """Endless per-step index lists: this rank's contiguous share of each global batch."""
        per_rank = global_batch // world_size
        while True:
            indices = self.take(global_batch)
            yield indices[rank * per_rank : (rank + 1) * per_rank]

    def __iter__(self) -> Iterator[int]:
        # As a plain Sampler: the rest of the current epoch.
        remaining = self.num_samples - self.position % self.num_samples
        yield from self.take(remaining)

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for num_samples={state['num_samples']}, seed={state['seed']}; "
                f"this sampler has num_samples={self.num_samples}, seed={self.seed}"
            )
        self.position = int(state["position"])

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_samples, generator=generator).tolist()
            else:
                order = list(range(self.num_samples))
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1]


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


def split_sizes(total: int, micro_batch: int) -> list[int]:
    """Sizes of consecutive micro-batches covering ``total`` (the last may be shorter)."""
    sizes = [micro_batch] * (total // micro_batch)
    if total % micro_batch:
        sizes.append(total % micro_batch)
    return sizes


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
