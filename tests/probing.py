"""Running a worker script as the supervisor would, with the probe on its PYTHONPATH, and reading
what the probe wrote (for the tests of oomguard/probe/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from support import ROOT

from oomguard.supervisor.run.process import with_probe


def probe_env(tmp: Path, pythonpath: str = str(ROOT), **extra: str) -> dict[str, str]:
    """The environment an attempt gets: the probe first on PYTHONPATH (runtime.with_probe), the channel."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    return {**env, "PYTHONPATH": with_probe(pythonpath), "OOMGUARD_EVENTS": str(tmp / "events.jsonl"),
            "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}


def run_probed(tmp: Path, argv: list[str], timeout: float = 300, **extra: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=probe_env(tmp, **extra))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def run_script(tmp: Path, source: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp / "train.py"
    script.write_text(source)
    return run_probed(tmp, [sys.executable, str(script), *args], **extra)


def records(tmp: Path, kind: str | None = None) -> list[dict[str, Any]]:
    path = tmp / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    found = [json.loads(line) for line in lines]
    return [r for r in found if kind is None or r["type"] == kind]


def last_step(tmp: Path, pid: int | None = None) -> int:
    """The step the probe counted last (in one process), checked against the steps it summed."""
    steps = [r for r in records(tmp, "step") if pid is None or r["pid"] == pid]
    assert steps, records(tmp)
    return int(steps[-1]["step"])
