"""`oomguard run --notify` delivers through Apprise (``json://``) and to a plain webhook, both real local
receivers, on a recovered OOM and on success."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from support import WORKER, oomguard


def test_notifications_for_recovered_oom_and_success(run_dir: Path) -> None:
    received: dict[str, list[dict]] = {"/apprise": [], "/plain": []}  # type: ignore[type-arg]

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received[self.path].append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        where = f"127.0.0.1:{server.server_port}"
        out = oomguard("run", "--run-dir", str(run_dir), "--no-web", "--notify", f"json://{where}/apprise",
                       "--notify", f"http://{where}/plain", "--micro-batch", "8", "--grad-accum", "1", "--",
                       sys.executable, WORKER, "torch_oom", "--fail-above", "4")
        assert out.returncode == 0, out.stderr
    finally:
        server.shutdown()
    assert "degraded" not in out.stderr
    apprise, plain = received["/apprise"], received["/plain"]
    assert [(b["type"], b["title"]) for b in apprise] == [("info", f"oomguard: {run_dir.name} recovered from cuda_oom"),
                                                         ("success", f"oomguard: {run_dir.name} finished")]
    assert apprise[0]["message"].startswith("cuda_oom at micro-batch 8; restarting at 4 x 2 accumulation\n")
    assert apprise[1]["message"].startswith("succeeded, attempt 2, micro-batch 4 × 2 × 1 = 8\n")
    assert [b["event"] for b in plain] == ["recovered", "succeeded"], plain
    assert "restarting at 4 x 2" in plain[0]["message"] and plain[0]["details"]["attempt"] == 1
