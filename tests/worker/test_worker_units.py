"""The pure and small parts: batch arithmetic, the tuner, the sampler, checkpoints, RNG,
configuration from the environment, the request channel."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from oomguard.worker import (
    CheckpointError,
    CheckpointStore,
    ResumableSampler,
    Session,
    SessionConfig,
    Tuner,
    load,
    shrink,
)
from oomguard.worker import checkpoint as rng_state
from oomguard.worker.batching import grow, split_sizes
from oomguard.worker.data import batch_size, slice_batch
from oomguard.worker.link import Requests


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


def test_batches_slice_tensors_tuples_dicts_and_lists() -> None:
    batch = {"x": torch.arange(10).view(5, 2), "ids": list("abcde"), "pair": (torch.zeros(5), torch.ones(5))}
    assert batch_size(batch) == 5
    part = slice_batch(batch, 1, 3)
    assert (
        part["x"].tolist() == [[2, 3], [4, 5]] and part["ids"] == ["b", "c"] and part["pair"][1].shape == (2,)
    )


def _session(**config: Any) -> Session:
    model = torch.nn.Linear(2, 1)
    loss = lambda m, b: m(b).sum()  # noqa: E731
    return Session(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, SessionConfig(**config))


def test_supervisor_variables_set_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OOMGUARD_GLOBAL_BATCH", "64")
    monkeypatch.setenv("OOMGUARD_WORLD_SIZE", "2")
    monkeypatch.setenv("OOMGUARD_GRAD_ACCUM", "4")
    session = _session()
    assert (session.per_process, session.micro_batch, session.grad_accum) == (32, 8, 4)
    monkeypatch.setenv("OOMGUARD_MICRO_BATCH", "16")
    assert _session().micro_batch == 16
    with pytest.raises(ValueError, match="OOMGUARD_GLOBAL_BATCH=64 but SessionConfig.global_batch=32"):
        _session(global_batch=32)
    monkeypatch.setenv("OOMGUARD_MICRO_BATCH", "64")
    with pytest.raises(ValueError, match="above the per-process batch 32"):
        _session()


def test_config_errors_name_the_option() -> None:
    with pytest.raises(ValueError, match="global_batch"):
        _session()
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
        SessionConfig(global_batch=8, checkpoint_every=5)
    with pytest.raises(ValueError, match="grow_margin"):
        SessionConfig(global_batch=8, grow_margin=1.5)


def test_resume_from_the_supervisors_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _session(global_batch=4, checkpoint_dir=str(tmp_path))
    first.step(torch.ones(4, 2))
    older = first.save(sync=True)
    first.step(torch.ones(4, 2))
    first.save(sync=True)
    monkeypatch.setenv("OOMGUARD_CHECKPOINT", str(older))
    again = _session(global_batch=4, checkpoint_dir=str(tmp_path))
    assert again.start() == 1, "OOMGUARD_CHECKPOINT wins over the newest"
    again.close(final_checkpoint=False)
    (tmp_path / "checkpoint-1" / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        _session(global_batch=4, checkpoint_dir=str(tmp_path)).start()


def test_request_file_is_seen_without_a_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    request = tmp_path / "req"
    monkeypatch.setenv("OOMGUARD_CHECKPOINT_REQUEST", str(request))
    requests = Requests()
    assert not requests.checkpoint_wanted()
    request.touch()
    assert requests.checkpoint_wanted()
    requests.checkpoint_done()
    assert not request.exists()


def test_records_follow_the_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OOMGUARD_EVENTS", str(tmp_path / "ev"))
    session = _session(global_batch=4, progress_every_s=0)
    session.step(torch.ones(4, 2))
    progress = [json.loads(line) for line in (tmp_path / "ev").read_text().splitlines()][-1]
    assert progress["type"] == "progress" and progress["step"] == 1 and progress["samples"] == 4
    assert {"loss", "micro_batch", "grad_accum", "samples_per_s", "rss_bytes"} <= progress.keys()
