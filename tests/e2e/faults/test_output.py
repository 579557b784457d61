"""Worker output: chunked reads, bounded lines, ``\\r`` as a line end, floods looked at cheaply."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from support import ROOT, oomguard

from oomguard.supervisor.observe.output import OutputScanner
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.run.process import LineSplitter

WORKER = str(Path(__file__).with_name("worker.py"))
BASE = ["--micro-batch", "1", "--grad-accum", "1", "--backoff", "0.05", "--max-backoff", "0.2"]


def test_carriage_return_ends_a_line_and_long_lines_are_cut() -> None:
    split = LineSplitter(line_max=10, flood_lines=64)
    assert split.feed(b"a\r b\r\nc") == [b"a", b" b"]
    assert split.feed(b"\r") == [b"c"]
    assert split.feed(b"\nd\n") == [b"d"]  # \r then \n in the next read: one line end, not two
    assert split.feed(b"x" * 25) == [b"x" * 10, b"x" * 10]  # no newline yet: cut at the cap, not held
    assert split.flush() == [b"x" * 5]


def test_a_flood_hands_on_only_the_newest_lines_where_the_failure_is() -> None:
    split = LineSplitter(flood_lines=8)
    body = b"".join(b"step %d loss 0.1\n" % i for i in range(50_000))
    oom = b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    lines = split.feed(body + b"Traceback (most recent call last):\n" + oom)
    assert len(lines) == 8 and lines[-1] == oom.rstrip() and lines[-3] == b"step 49999 loss 0.1"
    assert split.skipped_bytes > len(body) - 200
    scan = OutputScanner()
    for line in lines:
        scan.feed(line.decode())
    assert scan.device_oom is not None and scan.tried_bytes == 2 * 2**30


def test_few_lines_per_read_are_all_seen() -> None:
    split = LineSplitter()
    seen = [line for i in range(1000) for line in split.feed(b"step %d\n" % i)]
    assert len(seen) == 1000 and split.skipped_bytes == 0


def test_a_progress_bar_without_newlines_is_not_a_hang(run_dir: Path) -> None:
    done = oomguard("run", "--run-dir", str(run_dir), "--no-web", *BASE, "--hang-timeout", "1.5",
                    "--max-restarts", "0", "--", sys.executable, WORKER, "progress_bar", "--seconds", "4",
                    timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hung" not in done.stderr


def test_a_50_mib_line_neither_stalls_the_api_nor_grows_the_supervisor(run_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sup = subprocess.Popen([sys.executable, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--port", "0",
                            *BASE, "--", sys.executable, WORKER, "long_line", "--mib", "50", "--after", "2"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = _web_url(run_dir)
        token = (run_dir / "token").read_text().strip()
        worst, hwm, polls = 0.0, 0, 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
            while sup.poll() is None:
                t0 = time.monotonic()
                try:
                    client.get("/api/status").raise_for_status()
                    hwm = _peak_rss(sup.pid)
                except (httpx.TransportError, OSError):
                    sup.wait(10)  # the run ended: the dashboard closes before the supervisor exits
                    break
                worst = max(worst, time.monotonic() - t0)
                polls += 1
                time.sleep(0.05)
        assert sup.wait(60) == 0, sup.stderr.read() if sup.stderr else ""
    finally:
        sup.kill()
        sup.wait()
    assert polls > 10, "the run ended before the API was probed"
    assert worst < 1.5, f"the API stalled {worst:.2f} s during the long line"
    assert hwm < 200 * 2**20, f"supervisor peak RSS {hwm / 2**20:.0f} MiB: the line was buffered whole"
    log = Journal(run_dir, readonly=True).attempts()[0]["log_path"]
    assert Path(log).stat().st_size > 50 * 2**20


def _web_url(run_dir: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "token").exists() and (url := Journal(run_dir, readonly=True).meta().get("web_url")):
            return str(url)
        time.sleep(0.1)
    raise AssertionError("the dashboard never started")


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def test_log_max_bytes_caps_an_attempts_log_keeping_head_and_tail(run_dir: Path) -> None:
    done = oomguard("run", "--run-dir", str(run_dir), "--no-web", *BASE, "--log-max-bytes", "1M", "--",
                    sys.executable, WORKER, "flood", "--mib", "8", timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    log = run_dir / "logs" / "attempt-1.log"
    data = log.read_bytes()
    assert len(data) <= 2**20 + 200, len(data)
    assert data.startswith(b"step 123456") and b"output cut here" in data and data.endswith(b"x" * 10 + b"\n")
