"""Restart latency of ``oomguard run``: from the worker's exit to the next worker running.

The worker stamps ``time.time()`` as its first and last act (a bare ``python -S`` process, so the
figure is the supervisor's cost plus one interpreter start, not the user's imports). It fails with
a CUDA OOM text at every micro-batch above 1, so one run gives ``log2(micro)`` restarts; the gap is
next-start minus previous-exit. ``--backoff 0``: memory failures restart at once anyway.

    python bench/restart_latency.py --runs 5 --micro-batch 64
    python bench/restart_latency.py --runs 5 --with-dashboard   # also with the web server on
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = r"""
import os, sys, time
stamps = sys.argv[1]
with open(stamps, "a") as fh: fh.write(f"start {time.time()}\n")
micro = int(os.environ["OOMGUARD_MICRO_BATCH"])
if micro > 1:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", flush=True)
    with open(stamps, "a") as fh: fh.write(f"exit {time.time()}\n")
    os._exit(1)
"""


def one_run(tmp: Path, micro: int, web: bool) -> list[float]:
    stamps = tmp / "stamps"
    stamps.unlink(missing_ok=True)
    script = tmp / "worker.py"
    script.write_text(WORKER)
    web_args = ["--port", "0"] if web else ["--no-web"]
    run_dir = tmp / f"run-{len(list(tmp.iterdir()))}"
    subprocess.run([sys.executable, "-m", "oomguard", "run", "--run-dir", str(run_dir), *web_args,
                    "--micro-batch", str(micro), "--global-batch", str(micro), "--backoff", "0",
                    "--", sys.executable, "-S", str(script), str(stamps)],
                   check=True, capture_output=True, cwd=ROOT,
                   # a fresh fit store: a remembered size would skip the restarts being measured
                   env={**os.environ, "PYTHONPATH": str(ROOT), "OOMGUARD_CACHE_DIR": str(run_dir / "cache")})
    events = [line.split() for line in stamps.read_text().splitlines()]
    gaps = []
    for (kind, t), (next_kind, next_t) in zip(events, events[1:], strict=False):
        if kind == "exit" and next_kind == "start":
            gaps.append(float(next_t) - float(t))
    return gaps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=64, help="a power of two: log2 restarts per run")
    p.add_argument("--with-dashboard", action="store_true")
    args = p.parse_args()
    gaps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            gaps += one_run(Path(tmp), args.micro_batch, args.with_dashboard)
    ms = sorted(g * 1000 for g in gaps)
    result = {"restarts": len(ms), "median_ms": round(statistics.median(ms), 1),
              "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1), "max_ms": round(ms[-1], 1),
              "dashboard": args.with_dashboard}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
