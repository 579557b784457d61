"""Batch arithmetic: global = micro × accumulation × world, kept exact at every change.

Exact only where the script is told its accumulation. A script that takes only a micro-batch
(``--batch_size {micro_batch}``, most tutorials) cannot accumulate: its plan has accumulation 1,
its global batch follows the micro-batch, and ``asked_global`` keeps the global batch that was
asked for, so every figure shown is the one the script really trains at (``= 16 (asked 32)``).
Whether such a plan may shrink at all is the policy's question (``--allow-smaller-global-batch``).
"""

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
    """One attempt's batch shape. The global batch is fixed for the whole run, unless the script
    cannot accumulate (``asked_global`` set): then it is micro × world, and ``asked_global`` is
    the global batch asked for."""

    micro_batch: int
    global_batch: int
    world_size: int = 1
    asked_global: int | None = None  # set when the script takes no accumulation

    def __post_init__(self) -> None:
        per = self.per_process_batch
        if self.global_batch % self.world_size or per % self.micro_batch:
            raise ValueError(f"inexact batch plan {self}")
        if self.asked_global is not None and self.grad_accum != 1:
            raise ValueError(f"a script without accumulation cannot train at {self}")

    @property
    def accumulates(self) -> bool:
        """Is the script told its accumulation (so the global batch is kept)?"""
        return self.asked_global is None

    @property
    def asked(self) -> int:
        """The global batch asked for (the real one, ``global_batch``, is below it after a shrink)."""
        return self.global_batch if self.asked_global is None else self.asked_global

    @property
    def global_text(self) -> str:
        """The global batch as shown everywhere: ``32``, or ``16 (asked 32)`` after a shrink."""
        shrunk = self.global_batch != self.asked
        return f"{self.global_batch} (asked {self.asked})" if shrunk else str(self.global_batch)

    def describe(self) -> str:
        return (f"micro-batch {self.micro_batch} × accumulation {self.grad_accum} × world {self.world_size}"
                f" = {self.global_text}")

    def largest_at_most(self, limit: int, floor: int = 1) -> int | None:
        """The largest micro-batch in [floor, limit] this plan can run: a divisor of the per-process
        batch while the global batch is kept; any size (up to the asked one) when it cannot be."""
        if self.accumulates:
            return largest_divisor_at_most(self.per_process_batch, limit, floor)
        top = min(limit, self.asked // self.world_size)
        return top if top >= floor else None

    def fits(self, micro_batch: int) -> bool:
        return self.largest_at_most(micro_batch, micro_batch) == micro_batch

    @property
    def per_process_batch(self) -> int:
        return self.global_batch // self.world_size

    @property
    def grad_accum(self) -> int:
        return self.per_process_batch // self.micro_batch

    def with_micro_batch(self, micro_batch: int) -> BatchPlan:
        if not self.accumulates:  # accumulation stays 1: the global batch is what the micro-batch makes it
            return BatchPlan(micro_batch, micro_batch * self.world_size, self.world_size, self.asked_global)
        return BatchPlan(micro_batch, self.global_batch, self.world_size)
