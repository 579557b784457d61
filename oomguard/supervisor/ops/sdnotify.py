"""The sd_notify protocol: telling systemd that the supervisor is ready, what it does, and alive.

A few ``KEY=value`` lines in one datagram to the AF_UNIX socket named by ``NOTIFY_SOCKET`` (a path,
or ``@name`` for the abstract namespace). Without ``NOTIFY_SOCKET`` every call is a no-op, so the
loop calls these unconditionally. A failed send is logged once and never stops supervision.

Use from the loop::

    notifier = SystemdNotifier.from_env()
    watchdog = Watchdog.from_env(notifier)
    notifier.ready("running attempt 1 at micro-batch 8")   # once the worker runs
    while ...:
        watchdog.tick()                                     # sends only when due
        notifier.status("recovering: cuda_oom at micro 8 -> 4")
    notifier.stopping()
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

READY = "READY=1"
STOPPING = "STOPPING=1"
WATCHDOG = "WATCHDOG=1"
_STATUS_MAX = 200  # systemctl status shows one line; keep it short


class SystemdNotifier:
    """Sends sd_notify messages to one socket address; a no-op when the address is None."""

    def __init__(self, address: str | None) -> None:
        self._address = _socket_address(address) if address else None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SystemdNotifier:
        return cls(env.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *fields: str) -> bool:
        """Send ``fields`` (``KEY=value`` each) in one datagram; True when it was delivered."""
        if self._address is None:
            return False
        payload = "\n".join(fields).encode("utf-8", "replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(payload, self._address)
        except OSError as error:
            self._warn(error)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send(READY, *_status_field(status))

    def status(self, text: str) -> bool:
        return self.send(*_status_field(text))

    def stopping(self, status: str | None = None) -> bool:
        return self.send(STOPPING, *_status_field(status))

    def watchdog(self) -> bool:
        return self.send(WATCHDOG)

    def _warn(self, error: OSError) -> None:
        if not self._warned:  # systemd going away must not flood the log once per tick
            log.warning("sd_notify to %s failed: %s", os.environ.get("NOTIFY_SOCKET"), error)
            self._warned = True


class Watchdog:
    """Pings systemd's watchdog at half of ``WATCHDOG_USEC``; ``tick()`` sends only when due."""

    def __init__(
        self,
        notifier: SystemdNotifier,
        interval_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._notifier = notifier
        self.interval_s = interval_s if notifier.enabled else None
        self._clock = clock
        self._next: float | None = None

    @classmethod
    def from_env(
        cls,
        notifier: SystemdNotifier,
        env: Mapping[str, str] = os.environ,
        clock: Callable[[], float] = time.monotonic,
    ) -> Watchdog:
        return cls(notifier, watchdog_interval(env), clock)

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None

    def tick(self) -> bool:
        """Send ``WATCHDOG=1`` if at least one interval passed since the last ping; True when sent."""
        if self.interval_s is None:
            return False
        now = self._clock()
        if self._next is not None and now < self._next:
            return False
        self._next = now + self.interval_s
        return self._notifier.watchdog()


def watchdog_interval(env: Mapping[str, str] = os.environ, pid: int | None = None) -> float | None:
    """Half of ``WATCHDOG_USEC`` in seconds, or None when the watchdog is off or meant for another PID."""
    raw = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner != str(pid if pid is not None else os.getpid()):
        return None
    try:
        usec = int(raw)
    except ValueError:
        return None
    return usec / 2_000_000 if usec > 0 else None


def _socket_address(address: str) -> str | bytes:
    # "@name" is the abstract namespace: a leading NUL byte on the wire.
    if address.startswith("@"):
        return b"\0" + address[1:].encode()
    return address


def _status_field(text: str | None) -> list[str]:
    if text is None:
        return []
    one_line = " ".join(text.split())
    return [f"STATUS={one_line[:_STATUS_MAX]}"]
