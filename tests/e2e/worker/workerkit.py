"""Helpers shared by the worker tests: running the demo (forked or as a real subprocess) and
reading what it left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "examples" / "train_worker_demo.py"
ZYGOTE = Path(__file__).resolve().parent / "zygote.py"

# A demo small enough for a step of a few milliseconds on one core.
SMALL = [
    "--dataset-size", "512", "--seq", "16", "--width", "32", "--hidden", "128",
    "--threads", "1", "--grow-after", "0",
]  # fmt: skip


class Zygote:
    """Client of zygote.py: forks demo workers from a process that has torch imported already."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return reply

    def spawn(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> int:
        return int(self._ask({"op": "spawn", "argv": argv, "env": env or {}, "log": str(log)})["pid"])

    def wait(self, pid: int) -> int:
        return int(self._ask({"op": "wait", "pid": pid})["status"])

    def run(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> int:
        return self.wait(self.spawn(argv, log, env))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def run_demo(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """The demo as a real, freshly started subprocess."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(DEMO), *argv],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def samples_per_step(path: Path) -> dict[int, list[int]]:
    """Step -> sorted sample ids; a step logged twice (replayed after a kill) keeps its last entry."""
    out: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = sorted(record["ids"])
    return out


def weights(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return state


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def wait_for(predicate: Any, timeout: float, interval: float = 0.0005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
