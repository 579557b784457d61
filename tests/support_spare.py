"""A project for the spare's tests (unit: tests/unit/supervisor/run/test_spare.py; under real runs:
tests/e2e/test_spare.py): a script in a subdirectory that imports a third-party module."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from support import ROOT

HEAVY = '''import os, time
IMPORTED_BY = os.getpid()
IMPORTED_AT = time.time()
'''


# What a script sees of itself: the spare must give it exactly what a direct run gives it.
SEEN = '''import json, os, sys
heavy_was_loaded = "heavymod" in sys.modules
import heavymod
print("SEEN " + json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
      "x": os.environ.get("X_PER_ATTEMPT"), "attempt": os.environ.get("OOMGUARD_ATTEMPT"),
      "stdin": sys.stdin.read(), "file": __file__, "prewarmed": heavy_was_loaded}), flush=True)
'''


def make_project(root: Path) -> Path:
    """A script in a subdirectory that imports a third-party module (a fake site-packages on PYTHONPATH)."""
    site = root / "site-packages" / "heavymod"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(HEAVY)
    (root / "sub").mkdir()
    (root / "sub" / "seen.py").write_text(SEEN)
    return root


def env_for(project: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k == "OOMGUARD_CACHE_DIR" or not k.startswith("OOMGUARD_")}
    return {**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{project / 'site-packages'}", **extra}


def wait_until(check: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
