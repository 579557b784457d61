"""sd_notify messages against a real AF_UNIX datagram socket, path and abstract namespace."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.supervisor.ops.hooks import SystemdNotifier, Watchdog, watchdog_interval


class Receiver:
    """What systemd does: a bound datagram socket collecting messages."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(2.0)

    def recv(self) -> list[str]:
        return self.sock.recv(4096).decode().split("\n")

    def pending(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(4096)
        except BlockingIOError:
            return False
        finally:
            self.sock.settimeout(2.0)
        return True


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[Receiver, str]]:
    path = str(tmp_path / "notify.sock")
    rx = Receiver(path)
    yield rx, path
    rx.sock.close()


def test_ready_status_stopping(receiver: tuple[Receiver, str]) -> None:
    rx, path = receiver
    notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("running attempt 1 at micro-batch 8")
    assert rx.recv() == ["READY=1", "STATUS=running attempt 1 at micro-batch 8"]
    assert notifier.status("recovering:\ncuda_oom  at 8")
    assert rx.recv() == ["STATUS=recovering: cuda_oom at 8"]  # one line, always
    assert notifier.stopping()
    assert rx.recv() == ["STOPPING=1"]


def test_abstract_namespace() -> None:
    name = f"oomguard-test-{os.getpid()}"
    rx = Receiver(b"\0" + name.encode())
    try:
        assert SystemdNotifier.from_env({"NOTIFY_SOCKET": "@" + name}).ready()
        assert rx.recv() == ["READY=1"]
    finally:
        rx.sock.close()


def test_no_socket_is_a_noop() -> None:
    notifier = SystemdNotifier.from_env({})
    assert not notifier.enabled
    assert not notifier.ready("x") and not notifier.status("x") and not notifier.stopping()
    watchdog = Watchdog.from_env(notifier, {"WATCHDOG_USEC": "1000000"})
    assert not watchdog.enabled and not watchdog.tick()


def test_socket_gone_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = SystemdNotifier(str(tmp_path / "missing.sock"))
    assert not notifier.status("a") and not notifier.status("b")
    assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1  # warned once


def test_watchdog_at_half_interval(receiver: tuple[Receiver, str]) -> None:
    rx, path = receiver
    now = [100.0]
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}
    watchdog = Watchdog.from_env(SystemdNotifier.from_env(env), env, clock=lambda: now[0])
    assert watchdog.interval_s == 1.0
    sent = []
    for t in (100.0, 100.4, 100.99, 101.0, 101.5, 102.2, 102.3):
        now[0] = t
        sent.append(watchdog.tick())
    assert sent == [True, False, False, True, False, True, False]
    assert [rx.recv() for _ in range(3)] == [["WATCHDOG=1"]] * 3
    assert not rx.pending()


def test_watchdog_with_the_real_clock(receiver: tuple[Receiver, str]) -> None:
    rx, path = receiver
    # A ping every 60 s: the second tick is not due however slowly a loaded machine gets to it
    # (the exact schedule is pinned with a scripted clock above).
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "120000000"}
    watchdog = Watchdog.from_env(SystemdNotifier.from_env(env), env)
    assert watchdog.interval_s == 60.0
    assert watchdog.tick() and not watchdog.tick()
    assert rx.recv() == ["WATCHDOG=1"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "junk"}, None),
        ({}, None),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}, 2.0),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env) == expected
