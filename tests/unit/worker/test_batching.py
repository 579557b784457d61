"""Batch arithmetic and the tuner (worker/batching.py); the worker's other small parts have their
modules' files beside this one."""

from __future__ import annotations

from typing import Any

import torch

from oomguard.worker import (
    Session,
    SessionConfig,
    Tuner,
    shrink,
)
from oomguard.worker.batching import grow, split_sizes


def test_shrink_takes_the_largest_divisor_at_most_half() -> None:
    assert shrink(256, 256) == 128
    assert shrink(96, 96) == 48 and shrink(96, 48) == 24 and shrink(96, 24) == 12
    assert shrink(96, 12) == 6 and shrink(96, 6) == 3 and shrink(96, 3) == 1
    assert shrink(24, 24, floor=2) == 12 and shrink(24, 3, floor=2) is None
    assert shrink(10, 10) == 5 and shrink(10, 5) == 2  # never 4: it does not divide 10


def test_grow_skips_failed_sizes_and_split_covers_everything() -> None:
    assert (
        grow(96, 12, set(), 96) == 16 and grow(96, 12, {16, 24}, 96) == 32 and grow(96, 96, set(), 96) is None
    )
    assert split_sizes(10, 4) == [4, 4, 2] and split_sizes(8, 8) == [8] and sum(split_sizes(97, 10)) == 97


def test_tuner_lifecycle() -> None:
    tuner = Tuner(per_process=64, current=64, grow_after=2)
    assert (d := tuner.on_oom()) is not None and (d.micro_batch, d.reason) == (32, "oom")
    assert tuner.on_success(1e6, 1e12) is None  # 1 stable step of 2
    grown = tuner.on_success(1e6, 1e12)
    assert grown is None, "64 failed: never tried again"
    tuner = Tuner(per_process=64, current=8, grow_after=1)
    assert (d := tuner.on_success(1000.0, 1e9)) is not None and (d.micro_batch, d.reason) == (16, "grow")
    assert (d := tuner.on_oom()) is not None and (d.micro_batch, d.reason) == (8, "grow_failed")
    assert (d := tuner.on_success(1000.0, 1e9)) is not None and d.micro_batch == 32, "16 failed: skipped"
    tuner = Tuner(per_process=64, current=8, grow_after=1)
    assert tuner.on_success(1e6, 15e6) is None, "16 x 1 MB does not fit in 85% of 15 MB"
    assert tuner.on_success(None, 1e9) is None, "no measurement, no growth"










def _session(**config: Any) -> Session:
    model = torch.nn.Linear(2, 1)
    loss = lambda m, b: m(b).sum()  # noqa: E731
    return Session(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, SessionConfig(**config))










