"""`oomguard run --notify` posts to a real local receiver on a recovered OOM and on success."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from support import WORKER, oomguard


def test_webhooks_for_recovered_oom_and_success(run_dir: Path) -> None:
    received: list[dict] = []  # type: ignore[type-arg]

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/hook"
        out = oomguard("run", "--run-dir", str(run_dir), "--no-web", "--notify", url, "--micro-batch", "8",
                       "--grad-accum", "1", "--", sys.executable, WORKER, "torch_oom", "--fail-above", "4")
        assert out.returncode == 0, out.stderr
    finally:
        server.shutdown()
    events = [r["event"] for r in received]
    assert events == ["recovered", "succeeded"], received
    assert "cuda_oom at micro-batch 8" in received[0]["message"]
    assert "restarting at 4 x 2" in received[0]["message"]
