"""Micro-batch arithmetic and the in-process tuner: shrink on OOM, grow back when it fits.

Pure code, no torch and no I/O, so the rules are tested alone. The per-process batch never
changes; only its split into ``micro_batch x grad_accum`` does, always by an exact divisor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from oomguard.common.batch import divisors


def shrink(per_process: int, failed: int, floor: int = 1) -> int | None:
    """Largest divisor of ``per_process`` at most half of ``failed`` and at least ``floor``."""
    fits = [d for d in divisors(per_process) if floor <= d <= failed // 2]
    return max(fits) if fits else None


def grow(per_process: int, current: int, banned: set[int], ceiling: int) -> int | None:
    """Smallest divisor of ``per_process`` above ``current`` not yet failed, at most ``ceiling``."""
    fits = [d for d in divisors(per_process) if current < d <= ceiling and d not in banned]
    return min(fits) if fits else None


def split_sizes(total: int, micro_batch: int) -> list[int]:
    """Sizes of consecutive micro-batches covering ``total`` (the last may be shorter)."""
    sizes = [micro_batch] * (total // micro_batch)
    if total % micro_batch:
        sizes.append(total % micro_batch)
    return sizes


@dataclass
class BatchDecision:
    """What the tuner wants after an event: a new micro-batch and why (protocol ``reason``)."""

    micro_batch: int
    reason: str


@dataclass
class Tuner:
    """The micro-batch state of one process.

    Lifecycle: ``current`` starts at the configured size; an OOM shrinks it (``oom``) or, during a
    trial of a larger size, reverts to the last stable one (``grow_failed``); after
    ``grow_after`` stable steps, a larger size that the memory model predicts to fit under
    ``margin`` is tried (``grow``). A size that ever failed is never tried again.
    """

    per_process: int
    current: int
    floor: int = 1
    grow_after: int | None = 50
    margin: float = 0.15
    failed: set[int] = field(default_factory=set)
    stable: int | None = None  # last size that completed a step; None before the first
    trial: bool = False
    stable_steps: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.current <= self.per_process:
            raise ValueError(
                f"micro_batch={self.current} must be between 1 and the per-process batch {self.per_process}"
            )

    @property
    def grad_accum(self) -> int:
        # A starting size that does not divide the batch gives a shorter last micro-batch.
        return -(-self.per_process // self.current)

    def on_oom(self) -> BatchDecision | None:
        """The size to retry at after an OOM, or None when nothing smaller is allowed."""
        self.failed.add(self.current)
        self.stable_steps = 0
        if self.trial and self.stable is not None:
            return self._switch(self.stable, "grow_failed", trial=False)
        smaller = shrink(self.per_process, self.current, self.floor)
        return None if smaller is None else self._switch(smaller, "oom", trial=False)

    def on_success(self, bytes_per_sample: float | None, headroom: float | None) -> BatchDecision | None:
        """Count a completed step; maybe propose a larger size that the memory model says fits."""
        self.stable, self.trial = self.current, False
        self.stable_steps += 1
        if self.grow_after is None or self.stable_steps < self.grow_after:
            return None
        candidate = grow(self.per_process, self.current, self.failed, self.per_process)
        if candidate is None or not self._fits(candidate, bytes_per_sample, headroom):
            return None
        return self._switch(candidate, "grow", trial=True)

    def _fits(self, candidate: int, bytes_per_sample: float | None, headroom: float | None) -> bool:
        if bytes_per_sample is None or headroom is None:
            return False  # no measurement, no gamble
        return bytes_per_sample * candidate <= (1.0 - self.margin) * headroom

    def _switch(self, size: int, reason: str, *, trial: bool) -> BatchDecision:
        self.current, self.trial, self.stable_steps = size, trial, 0
        return BatchDecision(size, reason)

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.stable or self.current, "failed": sorted(self.failed)}

    def load_failed(self, failed: Sequence[int]) -> None:
        self.failed.update(int(f) for f in failed)
