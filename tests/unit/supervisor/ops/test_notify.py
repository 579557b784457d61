"""Notifications against a real HTTP receiver on 127.0.0.1: real Apprise deliveries (``json://``, ``ntfy://``),
plain webhooks, retries with backoff, a failing service as one degradation, a slow one, bad URLs."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support import oomguard
from support_notify import Receiver

from oomguard.supervisor.ops import notify
from oomguard.supervisor.ops.notify import Notifier, NotifyConfig, NotifyConfigError, Target, parse_target
from oomguard.supervisor.record.journal import Degradations

HOST = socket.gethostname()



@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _notifier(*specs: str, health: Any = None, **overrides: Any) -> Notifier:
    settings: dict[str, Any] = {"timeout_s": 2.0, "retries": 2, "backoff_s": 0.05, **overrides}
    return Notifier(notify.notify_config(specs, **settings), health=health)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens there once closed: connection refused


def test_apprise_delivers_to_a_local_json_endpoint(receiver: Receiver) -> None:
    sender = _notifier(f"json://{receiver.hostport}/hook")
    assert sender.lanes[0].target.apprise
    assert sender.send(notify.recovered("gpt", "cuda_oom", 16, 8, 8, attempt=2))
    assert sender.close(5.0)
    (path, body), = receiver.requests
    assert path == "/hook"
    assert body == {"version": "1.0", "title": "oomguard: gpt recovered from cuda_oom",
                    "message": "cuda_oom at micro-batch 16; restarting at 8 x 8 accumulation\n"
                               f"gpt on {HOST}, attempt 2",
                    "attachments": [], "type": "info"}
    assert receiver.headers[0]["Content-Type"] == "application/json"
    assert sender.delivered == 1 and sender.failed == 0


@pytest.mark.parametrize(("note", "kind"), [(notify.gave_up("gpt", "cuda_oom at the minimum micro-batch 1"), "failure"),
                                            (notify.succeeded("gpt", "done"), "success"),
                                            (notify.leak("gpt", "leak: worker RSS grew 4 MB/step"), "warning"),
                                            (notify.degraded("gpt", "journal", "disk full"), "warning")])
def test_each_event_has_its_apprise_type(receiver: Receiver, note: notify.Notification, kind: str) -> None:
    sender = _notifier(f"json://{receiver.hostport}/")
    sender.send(note)
    assert sender.close(5.0)
    assert receiver.requests[0][1]["type"] == kind and receiver.requests[0][1]["title"] == note.title


def test_plain_webhook_keeps_its_json(receiver: Receiver) -> None:
    sender = _notifier(receiver.url + "/hook")
    assert not sender.lanes[0].target.apprise  # no service claims 127.0.0.1: a generic webhook
    sender.send(notify.recovered("gpt", "cuda_oom", 16, 8, 8, attempt=2))
    assert sender.close(5.0)
    path, body = receiver.requests[0]
    assert path == "/hook" and body["event"] == "recovered" and body["run"] == "gpt"
    assert body["message"] == "cuda_oom at micro-batch 16; restarting at 8 x 8 accumulation"
    assert body["details"] == {"attempt": 2} and body["time"].endswith("+00:00")


def test_the_older_ntfy_form_goes_through_apprise(receiver: Receiver) -> None:
    target = parse_target(f"ntfy={receiver.url}/my-training")
    assert target == Target(f"ntfy://{receiver.hostport}/my-training", apprise=True)
    sender = _notifier(f"ntfy={receiver.url}/my-training")
    sender.send(notify.gave_up("gpt", "hang"))
    assert sender.close(5.0)
    path, body = receiver.requests[0]
    assert path == "/" and body["topic"] == "my-training" and body["title"] == "oomguard: gpt failed"
    assert body["message"].startswith("hang\ngpt on ")
    assert parse_target("ntfy=https://ntfy.sh/t") == Target("ntfys://ntfy.sh/t", apprise=True)


def test_service_urls_are_apprise_and_their_secrets_are_not_shown() -> None:
    slack = "https://hooks.slack.com/services/T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ"
    assert parse_target(f"slack={slack}") == Target(slack, apprise=True)  # the older form
    assert parse_target(slack).apprise
    telegram = parse_target("tgram://123456789:abcdefg_hijklmnop/12345")
    assert telegram.apprise and "abcdefg_hijklmnop" not in telegram.shown and telegram.shown.startswith("tgram://")
    assert "s3cret" not in parse_target("https://example.org/hook/s3cret").shown


def test_retries_with_backoff_then_delivers(receiver: Receiver) -> None:
    receiver.statuses = [503, 500]
    sender = _notifier(f"json://{receiver.hostport}/", backoff_s=0.2)
    started = time.monotonic()
    sender.send(notify.succeeded("gpt", "finished 5000 steps"))
    assert sender.close(5.0)
    assert len(receiver.requests) == 3 and sender.delivered == 1
    assert time.monotonic() - started >= 0.2 + 0.4  # waited, doubling, between tries


def test_a_failing_service_is_one_degradation_and_recovers(receiver: Receiver) -> None:
    said: list[str] = []
    health = Degradations(said.append)
    receiver.statuses = [500] * 4  # two notifications, each tried twice, all refused; then accepted
    sender = _notifier(f"json://{receiver.hostport}/hook", health=health, retries=1)
    component = f"notify json://{receiver.hostport}/hook"
    for _ in range(2):
        sender.send(notify.succeeded("gpt", "done"))
    receiver.wait_for(4)
    wait_until(lambda: sender.failed == 2)  # the second's last refusal is counted after it arrived
    assert health.is_degraded(component)
    sender.send(notify.succeeded("gpt", "done"))
    assert sender.close(5.0)
    assert not health.is_degraded(component) and sender.delivered == 1
    assert len(said) == 2, said
    assert said[0].startswith(f"{component} degraded: Failed to send JSON POST notification")
    assert said[0].endswith("(2 tries); the worker keeps running")
    assert said[1].startswith(f"{component} recovered after ") and "(2 notifications lost" in said[1]


def test_a_dead_service_does_not_delay_the_others(receiver: Receiver) -> None:
    """The live service gets the notification while the dead one is still backing off (its next try
    is a minute away): each target has its own thread. How fast send() returns is measured in
    bench/notify_latency.py, not asserted here."""
    said: list[str] = []
    sender = _notifier(f"json://127.0.0.1:{_closed_port()}/", f"json://{receiver.hostport}/",
                       health=Degradations(said.append), retries=2, backoff_s=60.0)
    assert sender.send(notify.succeeded("gpt", "done"))
    receiver.wait_for(1, timeout_s=30.0)
    wait_until(lambda: sender.delivered == 1)
    assert sender.failed == 0  # the dead one has not given up: it waits out its backoff
    sender.close(0.5)  # gives up the backoff still waiting
    assert sender.failed == 1 and sender.delivered == 1
    assert len(said) == 1 and "A Connection error occurred sending JSON notification" in said[0], said


def test_slow_service_never_blocks_the_caller(receiver: Receiver) -> None:
    """The service holds every request unanswered: all 20 sends return while the first is still
    held (none delivered), the queue's overflow is dropped and counted, and the request timeout
    cuts the held one short."""
    receiver.answer.clear()
    try:
        sender = _notifier(receiver.url, timeout_s=0.3, retries=0, queue_size=2)
        results = [sender.send(notify.recovered("gpt", "cuda_oom", 8, 4, 16)) for _ in range(20)]
        assert sender.delivered == 0  # every send returned without an answer from the service
        assert results[0] and sender.dropped >= 1 and results.count(True) + sender.dropped == 20
        receiver.wait_for(1)
        wait_until(lambda: sender.failed >= 1)  # the 0.3 s timeout cut the held request short
        assert sender.delivered == 0
    finally:
        receiver.answer.set()
    sender.close(10.0)


def test_close_is_bounded_while_retrying() -> None:
    sender = _notifier(f"json://127.0.0.1:{_closed_port()}/", retries=50, backoff_s=0.2)
    sender.send(notify.succeeded("gpt", "done"))
    started = time.monotonic()
    sender.close(0.5)  # gives up the backoff still waiting
    assert time.monotonic() - started < 2.0
    assert sender.failed == 1


def test_disabled_and_filtered() -> None:
    assert not Notifier(NotifyConfig()).send(notify.succeeded("gpt", "done"))
    only_failures = _notifier("http://127.0.0.1:9/", events=frozenset({notify.FAILED}))
    assert not only_failures.send(notify.succeeded("gpt", "done"))
    assert only_failures.close(1.0)


@pytest.mark.parametrize(("spec", "needle"), [
    ("foo://x", "not a URL Apprise can use"),
    ("tgram://bad", "not a URL Apprise can use"),
    ("ftp://example.org/x", "not a URL Apprise can use"),
    ("example.org/hook", "is not a URL"),
    ("https:///hook", "has no host"),
    ("slack=http://127.0.0.1:9/x", "slack://TOKEN_A/TOKEN_B/TOKEN_C"),
    ("ntfy=https://ntfy.sh/", "needs a topic"),
    ("json=ftp://x", "must be http:// or https://"),
])
def test_bad_urls_are_one_line(spec: str, needle: str) -> None:
    with pytest.raises(NotifyConfigError) as caught:
        parse_target(spec)
    text = str(caught.value)
    assert text.startswith("--notify: ") and needle in text and "\n" not in text


def test_bad_config_is_one_line() -> None:
    for make, needle in ((lambda: NotifyConfig(timeout_s=0), "timeout"),
                         (lambda: NotifyConfig(events=frozenset({"done"})), "unknown")):
        with pytest.raises(NotifyConfigError, match=needle):
            make()


def test_run_refuses_a_bad_notify_url_before_starting(tmp_path: Path) -> None:
    out = oomguard("run", "--run-dir", str(tmp_path / "r"), "--notify", "tgram://bad", "--micro-batch", "2",
                   "--grad-accum", "1", "--", "true")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("oomguard: error: --notify: 'tgram://…' is not a URL Apprise can use")
    assert not (tmp_path / "r").exists()


def test_notify_test_command(receiver: Receiver) -> None:
    dead = f"json://127.0.0.1:{_closed_port()}/"
    ok = oomguard("notify-test", f"json://{receiver.hostport}/hook")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"sent to json://{receiver.hostport}/hook (") and ok.stderr == ""
    body = receiver.requests[0][1]
    assert body["title"] == "oomguard: test notification" and "reach you here" in body["message"]
    failed = oomguard("notify-test", dead, "--timeout", "2")
    assert failed.returncode == 1 and failed.stdout.startswith("failed: json://127.0.0.1:")
    assert "A Connection error occurred" in failed.stdout and failed.stderr == ""
    bad = oomguard("notify-test", "foo://x")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--notify" in bad.stderr


def test_each_new_degradation_is_told_once() -> None:
    from oomguard.supervisor.ops.hooks import _on_degradation

    health = Degradations(lambda text: None)
    told: list[tuple[str, str]] = []
    tick = _on_degradation(SimpleNamespace(degradations=health), lambda c, m: told.append((c, m)))  # type: ignore[arg-type]
    tick()
    health.failed("journal", "database or disk is full")
    health.failed("notify json://x/", "refused")  # the notifier's own: said on the console only
    tick()
    health.failed("journal", "again")  # the same degradation going on: not told again
    tick()
    health.recovered("journal")
    health.failed("web", "the dashboard server stopped")
    tick()
    assert told == [("journal", "database or disk is full"), ("web", "the dashboard server stopped")]
