"""What watching a worker costs the supervisor: CPU seconds and RSS of the watching process.

Starts a worker that looks like training from the outside (a parent holding 256 MiB and two
forked "dataloader" children), then runs one watch tick per interval for ``--seconds`` and
reports the watcher's own CPU time (user + system, children excluded) and RSS. The budget from
the memory-watch issue: at most 1 % of one core and 150 MB RSS at 1 Hz.

    .venv/bin/python bench/watch_cost.py --seconds 600

``make_tick`` is the boundary: today a tick is one sample, the threshold check and the peak
fold; when the supervisor's event loop exists, swap in a tick that runs the real loop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.memory import AttemptPeak, Sampler, fold_peak
from supervisor.thresholds import Thresholds, evaluate

WORKER = """
import os, time
block = bytearray(256 * 1024 * 1024)
for i in range(0, len(block), 4096): block[i] = 1
for _ in range(2):
    if os.fork() == 0:
        data = bytearray(64 * 1024 * 1024)
        for i in range(0, len(data), 4096): data[i] = 1
        while True: time.sleep(1)
while True:
    sum(range(20000))  # a little work so the tree is alive, not idle
    time.sleep(0.05)
"""


def start_worker() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", WORKER], start_new_session=True)


def make_tick(worker_pid: int) -> Callable[[], None]:
    """One watch step as the supervisor does it: sample, judge, keep the attempt's peak."""
    sampler = Sampler()
    limits = Thresholds(memory_limit_bytes=8 * 1024**3)
    peak: list[AttemptPeak | None] = [None]

    def tick() -> None:
        sample = sampler.sample(worker_pid)
        evaluate(sample, limits, checkpoint_pending=False)
        peak[0] = fold_peak(peak[0], sample)

    return tick


def watch(tick: Callable[[], None], seconds: float, interval: float) -> int:
    """Call ``tick`` every ``interval`` seconds (monotonic schedule, no drift); ticks run."""
    start = time.monotonic()
    ticks = 0
    while (now := time.monotonic()) - start < seconds:
        tick()
        ticks += 1
        time.sleep(max(0.0, start + ticks * interval - now - (time.monotonic() - now)))
    return ticks


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(seconds: float, interval: float) -> dict[str, float | int | str]:
    worker = start_worker()
    try:
        time.sleep(1.0)  # let the worker fault its memory in
        tick = make_tick(worker.pid)
        tick()  # warm-up: imports, NVML init, cgroup lookup are start-up costs, not watch costs
        cpu0, wall0 = cpu_seconds(), time.monotonic()
        ticks = watch(tick, seconds, interval)
        cpu, wall = cpu_seconds() - cpu0, time.monotonic() - wall0
    finally:
        os.killpg(worker.pid, 9)
        worker.wait()
    rss = psutil.Process().memory_info().rss
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "seconds": round(wall, 1),
        "interval_s": interval,
        "ticks": ticks,
        "cpu_seconds": round(cpu, 3),
        "cpu_pct_of_one_core": round(100 * cpu / wall, 3),
        "cpu_ms_per_tick": round(1000 * cpu / max(ticks, 1), 3),
        "rss_mb": round(rss / 1e6, 1),
        "peak_rss_mb": round(peak_rss / 1e6, 1),
        "budget": "<= 1% of one core, <= 150 MB RSS",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to watch (default 600)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1)")
    args = parser.parse_args()
    result = measure(args.seconds, args.interval)
    print(json.dumps(result, indent=2))
    ok = float(result["cpu_pct_of_one_core"]) <= 1.0 and float(result["peak_rss_mb"]) <= 150.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
