"""The request channel from the supervisor: a request file is seen without a signal (worker/channel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.worker.link import Requests


def test_request_file_is_seen_without_a_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    request = tmp_path / "req"
    monkeypatch.setenv("OOMGUARD_CHECKPOINT_REQUEST", str(request))
    requests = Requests()
    assert not requests.checkpoint_wanted()
    request.touch()
    assert requests.checkpoint_wanted()
    requests.checkpoint_done()
    assert not request.exists()

