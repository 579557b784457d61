"""Helpers shared by the test modules (importable as ``support``; conftest.py is not a module to
import from, since tests/web has its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "workers" / "behave.py")


class MemoryCgroups(Protocol):
    """The ``memory_cgroup`` fixture (tests/conftest.py): ``make(limit_bytes, name=...)`` makes a real memory
    cgroup with that limit under this process's own and returns its directory."""

    def __call__(self, limit_bytes: int, name: str = ...) -> Path: ...


def oomguard(*args: str, timeout: float = 60, cwd: Path | None = None, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess."""
    return subprocess.run([sys.executable, "-m", "oomguard", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kw)


def status(run_dir: Path) -> dict[str, Any]:
    out = oomguard("status", "--run-dir", str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
