"""Fixtures: a real ``oomguard run`` supervising a real worker, with its dashboard on 127.0.0.1."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared harness, for the test modules too
from harness import Run, start_run


@pytest.fixture(scope="session")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Micro-batch 16 and 8 OOM (real PyTorch text), 4 trains until stopped; shared, never controlled
    destructively (tests that restart or stop use their own run)."""
    run = start_run(tmp_path_factory.mktemp("live"))
    try:
        run.wait_for(lambda d: d["state"] == "running" and d["micro_batch"] == 4)
        yield run
    finally:
        run.stop()


@pytest.fixture()
def own_run(tmp_path: Path) -> Iterator[Run]:
    run = start_run(tmp_path, micro=4, global_batch=16)
    try:
        run.wait_for(lambda d: d["state"] == "running")
        yield run
    finally:
        run.stop()
