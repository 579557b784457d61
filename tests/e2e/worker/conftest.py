"""The worker demo's zygote, shared by this folder's files: one per file (module scope), since
scripts/test.sh runs a file's tests on one process."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers, for the test modules too
from workerkit import Zygote


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    server = Zygote()
    yield server
    server.close()
