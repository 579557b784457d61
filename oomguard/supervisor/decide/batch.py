"""Batch arithmetic: global = micro × accumulation × world, kept exact at every change."""

from __future__ import annotations

from dataclasses import dataclass


def divisors(n: int) -> list[int]:
    """All positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def largest_divisor_at_most(n: int, limit: int, floor: int = 1) -> int | None:
    """The largest divisor of n in [floor, limit], or None when there is none."""
    fitting = [d for d in divisors(n) if floor <= d <= limit]
    return fitting[-1] if fitting else None


@dataclass(frozen=True)
class BatchPlan:
    """One attempt's batch shape. The global batch is fixed for the whole run."""

    micro_batch: int
    global_batch: int
    world_size: int = 1

    def __post_init__(self) -> None:
        per = self.per_process_batch
        if self.global_batch % self.world_size or per % self.micro_batch:
            raise ValueError(f"inexact batch plan {self}")

    @property
    def per_process_batch(self) -> int:
        return self.global_batch // self.world_size

    @property
    def grad_accum(self) -> int:
        return self.per_process_batch // self.micro_batch

    def with_micro_batch(self, micro_batch: int) -> BatchPlan:
        return BatchPlan(micro_batch, self.global_batch, self.world_size)
