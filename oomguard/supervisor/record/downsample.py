"""Bounded storage for memory samples: which journal rows to keep as they age.

The journal stores one row per sample (1 Hz by default). ``rows_to_drop`` says which rows to
delete so that storage stays bounded on runs of weeks:

- samples younger than ``recent_s`` stay at full rate;
- older ones keep, per attempt and per time bucket, only the row with the highest host memory and
  the row with the highest GPU memory, so a chart of old history still shows the peaks; buckets
  grow coarser with age (``tiers``);
- every attempt's peak rows (host and GPU) are kept for ever.

Buckets are aligned to absolute time (not to "now"), so running it again over already thinned
rows keeps the same rows: the journal can call it every few minutes over the whole table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SampleRow:
    """The fields of a journal sample row that retention looks at. ``t`` in seconds (wall)."""

    id: int
    attempt: int
    t: float
    host_bytes: int | None
    gpu_bytes: int | None


@dataclass(frozen=True)
class Retention:
    """``recent_s`` at full rate, then (min age, bucket width) tiers, youngest tier first."""

    recent_s: float = 600.0
    tiers: tuple[tuple[float, float], ...] = ((600.0, 60.0), (86_400.0, 900.0))

    def __post_init__(self) -> None:
        ages = [age for age, _ in self.tiers]
        if self.recent_s < 0 or ages != sorted(ages) or any(width <= 0 for _, width in self.tiers):
            raise ValueError("retention tiers must have increasing ages and positive bucket widths")

    def bucket_width(self, age: float) -> float | None:
        """Bucket width for a row this old, or None while it is recent."""
        width = None
        for min_age, tier_width in self.tiers:
            if age >= min_age:
                width = tier_width
        return width if age >= self.recent_s else None


def rows_to_drop(rows: Iterable[SampleRow], now: float, policy: Retention | None = None) -> list[int]:
    """Ids of rows the journal may delete now (pure; ``rows`` in any order)."""
    policy = policy or Retention()
    rows = list(rows)
    keep = _attempt_peaks(rows)
    buckets: dict[tuple[int, float, int], list[SampleRow]] = {}
    for row in rows:
        width = policy.bucket_width(now - row.t)
        if width is None:
            keep.add(row.id)
            continue
        buckets.setdefault((row.attempt, width, int(row.t // width)), []).append(row)
    for members in buckets.values():
        keep.update(_bucket_keepers(members))
    return sorted(row.id for row in rows if row.id not in keep)


def _attempt_peaks(rows: Sequence[SampleRow]) -> set[int]:
    """Ids of each attempt's highest host row and highest GPU row (earliest on ties)."""
    best: dict[tuple[int, str], SampleRow] = {}
    for row in rows:
        for kind, value in (("host", row.host_bytes), ("gpu", row.gpu_bytes)):
            if value is None:
                continue
            current = best.get((row.attempt, kind))
            if current is None or value > _value(current, kind) or (
                value == _value(current, kind) and row.t < current.t
            ):
                best[(row.attempt, kind)] = row
    return {row.id for row in best.values()}


def _bucket_keepers(members: Sequence[SampleRow]) -> set[int]:
    keepers = {max(members, key=lambda r: (r.host_bytes or 0, -r.t)).id}
    if any(r.gpu_bytes is not None for r in members):
        keepers.add(max(members, key=lambda r: (r.gpu_bytes or 0, -r.t)).id)
    return keepers


def _value(row: SampleRow, kind: str) -> int:
    value = row.host_bytes if kind == "host" else row.gpu_bytes
    return value or 0
