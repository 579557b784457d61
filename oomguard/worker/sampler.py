"""A deterministic sampler that can stop and resume at any sample.

The order depends only on (seed, epoch): each epoch is a permutation drawn from its own
generator, so the position in samples is the whole state. Resuming at position p yields exactly
what an uninterrupted run yields from p on, whatever the micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


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
