"""The probe's invisibility matrix: a case is a real Python process run twice from the same seed,
once plain and once with the probe loaded as the supervisor loads it (``runtime.with_probe`` on
PYTHONPATH, ``OOMGUARD_EVENTS``), and the two must not differ (docs/probe.md, "What it costs").

A case script imports ``matrix_report`` (tests/matrix/, on PYTHONPATH in both runs) and writes its
per-step losses (``float.hex``), step times and dynamo's counters to ``MATRIX_OUT``. Reusable by any
case: ``run_pair`` runs both, ``assert_invisible`` compares them, ``tax`` is the step-time ratio.
The inductor cache is shared by every run and test session (``INDUCTOR_CACHE``): the second run of a
pair, and the next CI run on the same box, take compiled kernels from it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.supervisor.run.process import with_probe

MATRIX_DIR = Path(__file__).resolve().parent / "matrix"
INDUCTOR_CACHE = Path(tempfile.gettempdir()) / "oomguard-tests-inductor"
# The counters a probe must not change: the graphs dynamo built, the frames it compiled, recompiles
# and graph breaks (their reasons are the keys). Cache hits and compile times may differ between runs.
COMPARED = {"stats": ("unique_graphs", "calls_captured"), "frames": None, "recompiles": None, "graph_break": None}


@dataclass
class Run:
    """One run of a case: what the script wrote, what the probe wrote (none when plain), its stderr."""

    losses: list[str]
    times: list[float]
    counters: dict[str, dict[str, int]]
    extra: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""

    def probe(self, state: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == "probe" and r.get("state") == state]

    def steps(self) -> int | None:
        """The step the probe counted last (highest over processes), None without step records."""
        found = [int(r["step"]) for r in self.records if r["type"] == "step"]
        return max(found) if found else None


def base_env(extra: dict[str, str]) -> dict[str, str]:
    """What both runs share: the matrix helpers on PYTHONPATH, one inductor cache, fixed hashing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    INDUCTOR_CACHE.mkdir(exist_ok=True)
    return {**env, "PYTHONPATH": str(MATRIX_DIR), "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE),
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", **extra}


def run_once(tmp: Path, argv: list[str], probed: bool, timeout: float = 300, **extra: str) -> Run:
    """Run ``argv`` (after the interpreter) in ``tmp`` plain or probed; fails on a non-zero exit."""
    tmp.mkdir(parents=True, exist_ok=True)
    out_file = tmp / "matrix.json"
    out_file.unlink(missing_ok=True)
    env = base_env({**extra, "MATRIX_OUT": str(out_file), "HF_HOME": str(tmp.parent / "hf"), "HF_HUB_OFFLINE": "1"})
    if probed:  # as the supervisor's attempt gets it (run/process.py)
        env.update(PYTHONPATH=with_probe(env["PYTHONPATH"]), OOMGUARD_EVENTS=str(tmp / "events.jsonl"))
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env)
    which = "probed" if probed else "plain"
    assert done.returncode == 0, f"{which} run failed:\n{done.stdout[-3000:]}{done.stderr[-5000:]}"
    data = json.loads(out_file.read_text())
    events = tmp / "events.jsonl"
    records = [json.loads(line) for line in events.read_text().splitlines()] if probed and events.exists() else []
    return Run(data.pop("losses"), data.pop("times"), data.pop("counters"), data, records, done.stderr)


def run_pair(tmp: Path, argv: list[str], timeout: float = 300, **extra: str) -> tuple[Run, Run]:
    """The case plain (in tmp/plain) then probed (in tmp/probed), from the same seed and arguments."""
    return (run_once(tmp / "plain", argv, False, timeout, **extra),
            run_once(tmp / "probed", argv, True, timeout, **extra))


def compared(counters: dict[str, dict[str, int]], skip: tuple[str, ...] = ()) -> dict[str, dict[str, int]]:
    picked: dict[str, dict[str, int]] = {}
    for kind, keys in COMPARED.items():
        if kind in skip:
            continue
        found = counters.get(kind, {})
        picked[kind] = {k: v for k, v in found.items() if keys is None or k in keys}
    return picked


def warnings(stderr: str) -> list[str]:
    """The warning lines a run printed (with their text, not where from: the two runs' tmp differ)."""
    return sorted(line.split("Warning:", 1)[1].strip() for line in stderr.splitlines() if "Warning:" in line)


def assert_invisible(plain: Run, probed: Run, skip_counters: tuple[str, ...] = ()) -> None:
    """The same losses bitwise, the same dynamo counters, the same warnings; the probe loaded."""
    assert plain.losses, "the case took no step"
    assert probed.losses == plain.losses, f"losses differ:\nplain  {plain.losses}\nprobed {probed.losses}"
    assert compared(probed.counters, skip_counters) == compared(plain.counters, skip_counters), (
        f"dynamo's counters differ:\nplain  {plain.counters}\nprobed {probed.counters}")
    assert warnings(probed.stderr) == warnings(plain.stderr), probed.stderr[-3000:]
    assert not probed.probe("failed"), probed.probe("failed")
    assert probed.probe("loaded") or probed.probe("partial"), probed.records


def steady(times: list[float], warmup: int) -> float:
    """The median step time after ``warmup`` steps (compiles, first allocations, the probe's first step)."""
    assert len(times) > warmup, times
    return statistics.median(times[warmup:])


def tax(plain: Run, probed: Run, warmup: int) -> float:
    """The probed run's steady step time over the plain run's."""
    return steady(probed.times, warmup) / steady(plain.times, warmup)
