"""How long ``Notifier.send`` keeps the event loop: the figure behind "a notification never blocks
the supervisor" (``oomguard/supervisor/ops/notify.py``), measured here rather than asserted in a test
(a loaded machine can miss any bound; tests/unit/supervisor/ops/test_notify.py checks the order of events instead).

Two targets on 127.0.0.1: one refuses connections (nothing listens: every try fails and backs off)
and one holds every request unanswered. ``send`` only queues, so its time is the queue's; once the
queues are full it drops and counts. Prints the median, p90 and largest ``send`` time.

    .venv/bin/python bench/notify_latency.py [--sends 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from oomguard.supervisor.ops import notify
from oomguard.supervisor.ops.notify import Notifier


class Held(BaseHTTPRequestHandler):
    """Reads the request and answers only once the benchmark is over."""

    release = threading.Event()

    def do_POST(self) -> None:  # the name http.server calls
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Held.release.wait(120)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sends", type=int, default=2000)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Held)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    specs = (f"json://127.0.0.1:{closed_port()}/", f"json://127.0.0.1:{server.server_address[1]}/")
    sender = Notifier(notify.notify_config(specs, timeout_s=60.0, retries=3, backoff_s=30.0))
    times = []
    for i in range(args.sends):
        started = time.perf_counter()
        sender.send(notify.recovered("bench", "cuda_oom", 8, 4, i))
        times.append(time.perf_counter() - started)
    Held.release.set()
    sender.close(1.0)
    server.shutdown()
    times.sort()
    figures = {"sends": len(times), "median_ms": 1000 * statistics.median(times),
               "p90_ms": 1000 * times[int(0.9 * len(times))], "max_ms": 1000 * times[-1],
               "dropped": sender.dropped}
    print(f"send(): median {figures['median_ms']:.3f} ms, p90 {figures['p90_ms']:.3f} ms, "
          f"max {figures['max_ms']:.2f} ms over {len(times)} sends to a dead and a held target "
          f"({figures['dropped']} dropped by full queues)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
