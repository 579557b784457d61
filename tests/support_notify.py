"""A real HTTP receiver on 127.0.0.1 for notifications (the tests of ops/notify.py and of the cause lines share it)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.headers: list[dict[str, str]] = []
        self.statuses: list[int] = []  # answers to give, in order; then 200
        self.delay_s = 0.0
        self.answer = threading.Event()  # cleared: hold every request unanswered until the test sets it
        self.answer.set()
        self.got = threading.Condition()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def wait_for(self, count: int, timeout_s: float = 5.0) -> None:
        with self.got:
            assert self.got.wait_for(lambda: len(self.requests) >= count, timeout_s), self.requests


class Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # the name http.server calls
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.got:
            self.server.requests.append((self.path, body))
            self.server.headers.append(dict(self.headers))
            self.server.got.notify_all()
            status = self.server.statuses.pop(0) if self.server.statuses else 200
        time.sleep(self.server.delay_s)
        self.server.answer.wait(60)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass

