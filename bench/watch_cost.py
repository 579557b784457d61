"""What watching a worker costs: CPU seconds and RSS of the real ``oomguard run`` process.

Starts ``oomguard run`` (the whole supervisor: event loop, 1 Hz memory sampling into the journal,
checkpoint watching, and the dashboard unless ``--no-web``) on a worker that looks like training
from the outside: a parent holding 256 MiB, two forked "dataloader" children, a line of output
and a progress record every second. After ``--seconds`` it reads the supervisor's own CPU time
(user + system; the worker and launcher are other processes) and RSS from /proc, then stops the
run. The budget from the memory-watch issue: at most 1 % of one core and 150 MB RSS at 1 Hz.

    .venv/bin/python bench/watch_cost.py --seconds 600
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
WORKER = """
import json, os, sys, time
block = bytearray(256 * 1024 * 1024)
for i in range(0, len(block), 4096): block[i] = 1
for _ in range(2):
    if os.fork() == 0:
        data = bytearray(64 * 1024 * 1024)
        for i in range(0, len(data), 4096): data[i] = 1
        while True: time.sleep(60)
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    with open(os.environ["OOMGUARD_EVENTS"], "a") as fh:
        fh.write(json.dumps({"type": "progress", "t": time.time(), "step": step}) + "\\n")
    time.sleep(1)
"""


def measure(seconds: float, web: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        web_args = ["--port", "0"] if web else ["--no-web"]
        sup = subprocess.Popen([sys.executable, "-m", "oomguard", "run", "--run-dir", f"{tmp}/run", *web_args,
                                "--micro-batch", "8", "--grad-accum", "1", "--checkpoint", f"{tmp}/ck/*",
                                "--resumes-itself", "--", sys.executable, str(script)],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        proc = psutil.Process(sup.pid)
        time.sleep(5)  # start-up (imports, first attempt) is not the steady cost being measured
        t0, cpu0 = time.monotonic(), sum(proc.cpu_times()[:2])
        peak_rss = 0
        while time.monotonic() - t0 < seconds:
            time.sleep(min(5.0, seconds))
            peak_rss = max(peak_rss, proc.memory_info().rss)
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        elapsed = time.monotonic() - t0
        sup.send_signal(signal.SIGTERM)
        sup.wait(60)
    return {"seconds": round(elapsed, 1), "dashboard": web, "cpu_seconds": round(cpu, 3),
            "core_percent": round(100 * cpu / elapsed, 3), "peak_rss_mb": round(peak_rss / 2**20, 1),
            "budget": "<= 1% of one core, <= 150 MB"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--no-web", action="store_true", help="measure without the dashboard")
    args = p.parse_args()
    result = measure(args.seconds, not args.no_web)
    print(json.dumps(result))
    return 0 if result["core_percent"] <= 1.0 and result["peak_rss_mb"] <= 150 else 1  # type: ignore[operator]


if __name__ == "__main__":
    sys.exit(main())
