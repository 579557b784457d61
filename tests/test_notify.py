"""Webhooks against a real HTTP receiver on 127.0.0.1: formats, retries, one down, one slow."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from oomguard.supervisor.ops import notify
from oomguard.supervisor.ops.notify import NotifyConfig, NotifyConfigError, Webhook, WebhookNotifier


class Receiver(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.statuses: list[int] = []  # answers to give, in order; then 200
        self.delay_s = 0.0
        self.got = threading.Condition()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def wait_for(self, count: int, timeout_s: float = 5.0) -> None:
        with self.got:
            assert self.got.wait_for(lambda: len(self.requests) >= count, timeout_s), self.requests


class Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # the name http.server calls
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.got:
            self.server.requests.append((self.path, body))
            self.server.got.notify_all()
            status = self.server.statuses.pop(0) if self.server.statuses else 200
        time.sleep(self.server.delay_s)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _notifier(*hooks: Webhook, **overrides: Any) -> WebhookNotifier:
    settings: dict[str, Any] = {"timeout_s": 2.0, "retries": 2, "backoff_s": 0.05, **overrides}
    return WebhookNotifier(NotifyConfig(webhooks=hooks, **settings))


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"  # nothing listens there now: connection refused


def test_generic_json(receiver: Receiver) -> None:
    sender = _notifier(Webhook(receiver.url + "/hook"))
    assert sender.send(notify.recovered("gpt", "cuda_oom", 16, 8, 8, attempt=2))
    assert sender.close(5.0)
    path, body = receiver.requests[0]
    assert path == "/hook"
    assert body["event"] == "recovered" and body["run"] == "gpt"
    assert body["message"] == "cuda_oom at micro-batch 16; restarting at 8 x 8 accumulation"
    assert body["details"] == {"attempt": 2}
    assert body["time"].endswith("+00:00")
    assert sender.delivered == 1 and sender.failed == 0


def test_slack_and_ntfy_bodies(receiver: Receiver) -> None:
    sender = _notifier(
        notify.parse_webhook(f"slack={receiver.url}/services/T/B/X"),
        Webhook(receiver.url + "/mytopic", "ntfy"),
    )
    sender.send(notify.gave_up("gpt", "cuda_oom at the minimum micro-batch 1"))
    assert sender.close(5.0)
    (slack_path, slack), (ntfy_path, ntfy) = receiver.requests
    assert slack_path == "/services/T/B/X" and set(slack) == {"text"}
    assert "gpt failed" in slack["text"] and "minimum micro-batch 1" in slack["text"]
    assert ntfy_path == "/"  # ntfy's JSON publishing goes to the server root
    assert ntfy["topic"] == "mytopic" and ntfy["priority"] == 5 and ntfy["message"].startswith("cuda_oom")


def test_retries_on_server_errors(receiver: Receiver) -> None:
    receiver.statuses = [503, 500]
    sender = _notifier(Webhook(receiver.url))
    sender.send(notify.succeeded("gpt", "finished 5000 steps"))
    assert sender.close(5.0)
    assert len(receiver.requests) == 3 and sender.delivered == 1


def test_client_errors_are_not_retried(receiver: Receiver) -> None:
    receiver.statuses = [404]
    sender = _notifier(Webhook(receiver.url))
    sender.send(notify.succeeded("gpt", "done"))
    sender.close(5.0)
    assert len(receiver.requests) == 1 and sender.failed == 1


def test_receiver_down_does_not_block_and_gives_up(receiver: Receiver) -> None:
    sender = _notifier(Webhook(_closed_port_url()), Webhook(receiver.url))
    started = time.monotonic()
    assert sender.send(notify.succeeded("gpt", "done"))
    assert time.monotonic() - started < 0.05
    assert sender.close(5.0)
    assert sender.failed == 1 and sender.delivered == 1  # the live one still got it
    assert len(receiver.requests) == 1


def test_slow_receiver_never_blocks_the_caller(receiver: Receiver) -> None:
    receiver.delay_s = 1.0
    sender = _notifier(Webhook(receiver.url), timeout_s=0.3, retries=0, queue_size=2)
    started = time.monotonic()
    results = [sender.send(notify.recovered("gpt", "cuda_oom", 8, 4, 16)) for _ in range(20)]
    elapsed = time.monotonic() - started
    assert elapsed < 0.1, f"send() blocked for {elapsed:.2f}s"
    assert results[0] and sender.dropped >= 1 and not all(results)  # the bounded queue overflowed
    receiver.wait_for(1)
    sender.close(3.0)
    assert sender.failed >= 1  # the 0.3 s timeout cut the slow request short


def test_close_is_bounded_while_retrying() -> None:
    sender = _notifier(Webhook(_closed_port_url()), retries=50, backoff_s=0.2)
    sender.send(notify.succeeded("gpt", "done"))
    started = time.monotonic()
    sender.close(0.5)  # gives up the backoff still waiting
    assert time.monotonic() - started < 2.0
    assert sender.failed == 1


def test_disabled_and_filtered() -> None:
    assert not WebhookNotifier(NotifyConfig()).send(notify.succeeded("gpt", "done"))
    only_failures = _notifier(Webhook("http://127.0.0.1:9/"), events=frozenset({notify.FAILED}))
    assert not only_failures.send(notify.succeeded("gpt", "done"))
    assert only_failures.close(1.0)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: Webhook("ftp://example.org/x"), "http"),
        (lambda: Webhook("https://example.org/x", "teams"), "format"),
        (lambda: Webhook("https://ntfy.sh/", "ntfy"), "topic"),
        (lambda: NotifyConfig(timeout_s=0), "--notify-timeout"),
        (lambda: NotifyConfig(events=frozenset({"done"})), "--notify-on"),
    ],
)
def test_bad_config_is_one_line(make: Any, needle: str) -> None:
    with pytest.raises(NotifyConfigError) as caught:
        make()
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_parse_webhook() -> None:
    assert notify.parse_webhook("https://x.org/a=b") == Webhook("https://x.org/a=b", "json")
    assert notify.parse_webhook("ntfy=https://ntfy.sh/t") == Webhook("https://ntfy.sh/t", "ntfy")
