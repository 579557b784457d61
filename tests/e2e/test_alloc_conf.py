"""What the worker got: expandable_segments:True in the allocator settings of a real run, as status says
(the merge itself is in tests/unit/supervisor/run/test_process.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import ROOT, WORKER, status

NEW, OLD = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"


def test_status_shows_what_the_worker_got(tmp_path: Path) -> None:
    """A user who set the new name keeps their settings; the retry after a fragmentation OOM gets
    expandable_segments:True under both names, and status says so."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--no-web", "--micro-batch", "16",
         "--global-batch", "64", "--", sys.executable, WORKER, "fragmented"],
        capture_output=True, text=True, timeout=90,
        env={**os.environ, "PYTHONPATH": str(ROOT), NEW: "max_split_size_mb:64"})
    assert out.returncode == 0, out.stderr
    doc = status(run_dir)
    assert doc["micro_batch"] == 16 and doc["expandable_segments"] is True
    merged = "max_split_size_mb:64,expandable_segments:True"
    assert doc["alloc_conf"] == {NEW: merged, OLD: merged}
    text = subprocess.run([sys.executable, "-m", "oomguard", "status", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert f"allocator:  {NEW}={merged}, {OLD}={merged}" in text
