"""The checkpoint store (atomic, pruned, broken ones skipped) and the RNG streams it captures
(worker/checkpoint.py)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from oomguard.worker import (
    CheckpointError,
    CheckpointStore,
    load,
)
from oomguard.worker import checkpoint as rng_state


def test_checkpoint_store_is_atomic_prunes_and_skips_broken(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        store.save(step, {"w": torch.full((3,), float(step))}, "fp")
    assert [c.step for c in store.complete()] == [2, 3]
    assert torch.equal(load(tmp_path / "checkpoint-3", "fp")["w"], torch.full((3,), 3.0))
    with pytest.raises(CheckpointError, match="different configuration"):
        load(tmp_path / "checkpoint-3", "other")
    # A killed writer's leftovers: an unmarked directory and a temp directory are never chosen.
    (tmp_path / "checkpoint-9").mkdir()
    (tmp_path / ".checkpoint-10.tmp-1-1").mkdir()
    assert store.latest() is not None and store.latest().step == 3  # type: ignore[union-attr]
    with pytest.raises(CheckpointError, match="incomplete"):
        load(tmp_path / "checkpoint-9")
    # A truncated state file is caught by the sizes in the marker.
    state = tmp_path / "checkpoint-3" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    assert store.latest() is not None and store.latest().step == 2  # type: ignore[union-attr]
    store.clean_stale()
    assert not (tmp_path / ".checkpoint-10.tmp-1-1").exists()


def test_rng_capture_restores_every_stream() -> None:
    state = rng_state.capture()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    torch.save(state, Path(os.devnull))  # plain types and tensors only
    rng_state.restore(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a

