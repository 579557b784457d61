"""Load check of the dashboard: 200 req/s of status polling plus one SSE client for 30 s while a
supervised worker trains and keeps running out of memory; compares the supervisor's restart
latency with and without that load.

    .venv/bin/python bench/web_load.py [--seconds 30] [--rate 200]

Restart latency = the next attempt's start (journal) minus the moment the previous worker exited
(written by the worker just before ``os._exit``), i.e. detection, classification, journal writes
and the spawn: what the web layer must not slow down. Both phases run the same job in fresh run
directories; the load generator runs in this process, the supervisor in its own.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "web"))
from harness import Run, start_run  # noqa: E402

WORKER = Path(__file__).with_name("web_load_worker.py")


@dataclass
class Load:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    sse_messages: int = 0


async def poll(client: httpx.AsyncClient, url: str, load: Load) -> None:
    start = time.perf_counter()
    try:
        response = await client.get(url)
        response.raise_for_status()
        load.latencies.append(time.perf_counter() - start)
    except httpx.HTTPError:
        load.errors += 1


async def listen(url: str, load: Load) -> None:
    async with httpx.AsyncClient(timeout=None) as client, client.stream("GET", url) as response:
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                load.sse_messages += 1


async def generate(base: str, seconds: float, rate: float) -> Load:
    """Open-loop load: a request every 1/rate s whether or not earlier ones have answered."""
    load = Load()
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=10, limits=limits) as client:
        sse = asyncio.create_task(listen(base + "api/stream", load))
        tasks, t0 = [], time.perf_counter()
        for i in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(poll(client, base + "api/status", load)))
        await asyncio.gather(*tasks)
        sse.cancel()
    return load


def restart_latencies(run: Run, exits_file: Path) -> list[float]:
    exits = dict(line.split() for line in exits_file.read_text().splitlines())
    attempts = {a["attempt"]: a["started"] for a in run.get("api/attempts").json()}
    return [attempts[int(n) + 1] - float(t) for n, t in exits.items() if int(n) + 1 in attempts]


def phase(seconds: float, rate: float | None) -> tuple[list[float], Load | None]:
    with tempfile.TemporaryDirectory(prefix="oomguard-bench-") as tmp:
        exits = Path(tmp) / "exits"
        run = start_run(Path(tmp), env={"EXITS": str(exits), "TRAIN_S": "1.0"}, micro=2**19,
                        global_batch=2**20, command=(sys.executable, str(WORKER)))
        try:
            run.wait_for(lambda d: d["state"] == "running", timeout=30)
            load = asyncio.run(generate(run.url, seconds, rate)) if rate else None
            if load is None:
                time.sleep(seconds)
            return restart_latencies(run, exits), load
        finally:
            run.stop()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(name: str, restarts: list[float], load: Load | None, seconds: float) -> None:
    ms = [1000 * v for v in restarts]
    print(f"{name}: {len(ms)} restarts, restart latency median {statistics.median(ms):.1f} ms, "
          f"p90 {pct(ms, 0.9):.1f} ms, max {max(ms):.1f} ms")
    if load:
        lat = [1000 * v for v in load.latencies]
        print(f"  status polling: {len(lat)} ok ({len(lat) / seconds:.0f}/s), {load.errors} errors, "
              f"p50 {pct(lat, 0.5):.1f} ms, p99 {pct(lat, 0.99):.1f} ms, max {max(lat):.1f} ms; "
              f"SSE messages received: {load.sse_messages}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=200.0, help="status requests per second")
    args = parser.parse_args()
    quiet, _ = phase(args.seconds, None)
    report("without load", quiet, None, args.seconds)
    loaded, load = phase(args.seconds, args.rate)
    report(f"with {args.rate:.0f} req/s + SSE", loaded, load, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
