from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def fit_store_per_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What earlier runs learned lives in a cache; each test starts with an empty one."""
    cache = tmp_path / "oomguard-cache"
    monkeypatch.setenv("OOMGUARD_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
