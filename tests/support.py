"""Helpers shared by the test modules (importable as ``support``; conftest.py is not a module to
import from, since tests/e2e/web has its own)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
WORKERS = TESTS / "workers"  # the training scripts the tests run (unit and e2e alike)
DATA = TESTS / "data"
WORKER = str(WORKERS / "behave.py")


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


def free_port_pair() -> int:
    """A port whose successor is free too (the rendezvous, and oomguard's store on port + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free pair of ports")
