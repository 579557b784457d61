"""The session's configuration from the supervisor's environment, its resume, the records it
writes, and a checkpoint request seen by its file without a signal (worker/session.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from oomguard.worker import (
    CheckpointError,
    Session,
    SessionConfig,
)
from oomguard.worker.session import Requests


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


def test_records_follow_the_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OOMGUARD_EVENTS", str(tmp_path / "ev"))
    session = _session(global_batch=4, progress_every_s=0)
    session.step(torch.ones(4, 2))
    progress = [json.loads(line) for line in (tmp_path / "ev").read_text().splitlines()][-1]
    assert progress["type"] == "progress" and progress["step"] == 1 and progress["samples"] == 4
    assert {"loss", "micro_batch", "grad_accum", "samples_per_s", "rss_bytes"} <= progress.keys()


def test_request_file_is_seen_without_a_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    request = tmp_path / "req"
    monkeypatch.setenv("OOMGUARD_CHECKPOINT_REQUEST", str(request))
    requests = Requests()
    assert not requests.checkpoint_wanted()
    request.touch()
    assert requests.checkpoint_wanted()
    requests.checkpoint_done()
    assert not request.exists()
