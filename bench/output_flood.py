"""What a worker's output costs it under oomguard: a flood of short lines, and one huge line.

1. ``--mib`` MiB (default 200) of short training-log lines, written as fast as Python can, once to a
   file (``worker > file``) and once under ``oomguard run`` (console to /dev/null). The worker times
   itself, so the figure is how much slower the *worker* runs because of us (the pipe filling up is
   what slows it). The issue's budget: within 2×.
2. One ``--line-mib`` MiB (default 50) line without a newline under ``oomguard run --port 0``: the
   slowest ``/api/status`` answer while it streams, and the supervisor's peak RSS (VmHWM).

    .venv/bin/python bench/output_flood.py [--mib 200] [--line-mib 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
FLOOD = """
import os, sys, time
line = b"step 123456 loss 0.123456 lr 0.000300 tokens/s 123456.7 mem 1234 MiB " + b"x" * 10 + b"\\n"
n = int(sys.argv[1]) * (1 << 20) // len(line)
out = os.fdopen(1, "wb", buffering=1 << 16, closefd=False)
t0 = time.perf_counter()
for _ in range(n):
    out.write(line)
out.flush()
open(sys.argv[2], "w").write(str(time.perf_counter() - t0))
"""
LONG_LINE = """
import sys, time
block = b"y" * (1 << 20)
for _ in range(int(sys.argv[1])):
    sys.stdout.buffer.write(block)
sys.stdout.buffer.flush()
time.sleep(1.0)
print("\\nline done", flush=True)
"""
BASE = ["--micro-batch", "1", "--grad-accum", "1", "--max-restarts", "0"]


def oomguard(*args: str) -> list[str]:
    return [sys.executable, "-m", "oomguard", "run", *args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def flood(tmp: Path, mib: int) -> dict[str, float]:
    worker = tmp / "flood.py"
    worker.write_text(FLOOD)
    timing = tmp / "t"
    with open(tmp / "to-file.log", "wb") as out:
        subprocess.run([sys.executable, str(worker), str(mib), str(timing)], stdout=out, check=True)
    to_file = float(timing.read_text())
    started = time.perf_counter()
    subprocess.run(oomguard("--run-dir", str(tmp / "run"), "--no-web", *BASE, "--", sys.executable, str(worker),
                            str(mib), str(timing)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True, env=env())
    total = time.perf_counter() - started
    under = float(timing.read_text())
    return {"mib": mib, "to_file_s": round(to_file, 2), "under_oomguard_s": round(under, 2),
            "ratio": round(under / to_file, 2), "oomguard_run_total_s": round(total, 2)}


def long_line(tmp: Path, mib: int) -> dict[str, float]:
    worker = tmp / "line.py"
    worker.write_text(LONG_LINE)
    run_dir = tmp / "run-line"
    sup = subprocess.Popen(oomguard("--run-dir", str(run_dir), "--port", "0", *BASE, "--", sys.executable,
                                    str(worker), str(mib)), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=env())
    while not (run_dir / "token").exists() and sup.poll() is None:
        time.sleep(0.05)
    url = _url(run_dir)
    token = (run_dir / "token").read_text().strip()
    latencies: list[float] = []
    hwm = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        while sup.poll() is None:
            t0 = time.perf_counter()
            try:
                client.get("/api/status")
                hwm = max(hwm, _hwm(sup.pid))
            except (httpx.TransportError, OSError):
                break
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    sup.wait(60)
    return {"line_mib": mib, "status_requests": len(latencies), "worst_status_s": round(max(latencies), 3),
            "supervisor_peak_rss_mib": round(hwm / 2**20, 1)}


def _url(run_dir: Path) -> str:
    from oomguard.supervisor.record.journal import Journal

    for _ in range(200):
        if url := Journal(run_dir, readonly=True).meta().get("web_url"):
            return str(url)
        time.sleep(0.05)
    raise SystemExit("the dashboard did not start")


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--mib", type=int, default=200)
    p.add_argument("--line-mib", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        result = {"flood": flood(Path(tmp), args.mib), "long_line": long_line(Path(tmp), args.line_mib)}
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
