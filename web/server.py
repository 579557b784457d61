"""The dashboard's server: uvicorn in a background thread of the supervisor process.

uvicorn normally owns the process's signals; here the supervisor does (its handlers set flags and
its loop acts), so ``_ThreadServer`` installs none. We bind the socket ourselves: a port in use is
then a one-line error (or, for the default port, a printed fallback to a free one) instead of a
log line from a background thread, and ``--port 0`` reports the port it got.
"""

from __future__ import annotations

import contextlib
import errno
import secrets
import socket
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from oomguard.supervisor.errors import UsageError
from oomguard.web.app import Control, create_app
from oomguard.web.exposure import BACKLOG, bounded_protocol, connection_cap, guard, is_loopback
from oomguard.web.files import write_private
from oomguard.web.sse import ChangeBroker

if TYPE_CHECKING:
    from oomguard.supervisor.run.loop import Supervisor

DEFAULT_PORT = 8765
TOKEN_NAME = "token"
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0


class _ThreadServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the supervisor."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29 used this name
        return


@dataclass
class WebServer:
    server: uvicorn.Server
    thread: threading.Thread
    broker: ChangeBroker
    url: str  # where clients on this machine reach it
    token: str

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Close live streams, let requests finish, then give up waiting (the thread is a daemon)."""
        self.broker.close()
        self.server.should_exit = True
        self.thread.join(timeout / 2)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout / 2)


def check_exposure(host: str, token: str | None) -> None:
    """Anyone who can reach a non-loopback address could stop the run: require a token there."""
    if not token and not is_loopback(host):
        raise UsageError("--host", f"refusing to serve the dashboard on {host} without a control token",
                         "bind to 127.0.0.1 (and use an SSH tunnel), or keep the token enabled")


def _url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def bind(host: str, port: int, fallback: bool) -> socket.socket:
    """A listening socket on host:port; with ``fallback``, any free port when that one is taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError("--host", f"cannot resolve {host!r} ({exc.strerror})", "use an IP address") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT after a restart is fine
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE and fallback:
            return bind(host, 0, False)
        raise _bind_error(host, port, exc) from None
    sock.listen(128)
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> UsageError:
    if exc.errno == errno.EADDRINUSE:
        return UsageError("--port", f"{host}:{port} is already in use",
                          "choose another --port (0: any free port) or pass --no-web")
    if exc.errno == errno.EACCES:
        return UsageError("--port", f"no permission to bind {host}:{port}", "use a port above 1023")
    return UsageError("--host", f"cannot bind {host}:{port} ({exc.strerror})",
                      "use an address of this machine")


def start_server(run_dir: Path, control: Control | None, host: str, port: int, *,
                 token: str | None = None, fallback: bool = False) -> WebServer:
    """Start serving ``run_dir`` in a daemon thread; returns once the server accepts connections."""
    token = token if token is not None else secrets.token_urlsafe(32)
    check_exposure(host, token)
    sock = bind(host, port, fallback)
    write_private(Path(run_dir) / TOKEN_NAME, token + "\n")
    broker = ChangeBroker()
    app = create_app(Path(run_dir), control, token, broker=broker)
    # log_config=None: leave the supervisor's logging alone; access_log off: 200 req/s of polling
    # must not flood the console (and headers, the token included, are never logged anyway).
    # Connections are capped by the file descriptors left after supervision's reserve (exposure.py).
    cap = connection_cap()
    config = uvicorn.Config(guard(app, host, token), log_config=None, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2, lifespan="on", limit_concurrency=cap,
                            backlog=BACKLOG, http=bounded_protocol(cap))
    server = _ThreadServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="oomguard-web", daemon=True)
    thread.start()
    _wait_started(server, thread)
    return WebServer(server, thread, broker, _url(host, sock.getsockname()[1]), token)


def _wait_started(server: uvicorn.Server, thread: threading.Thread) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the dashboard server did not start")
        time.sleep(0.01)


def start_dashboard(supervisor: Supervisor) -> WebServer:
    """Serve the supervisor's run: wake live streams on its events, record the URL for the CLI."""
    config = supervisor.config
    web = start_server(supervisor.run_dir, supervisor, config.host, config.port,
                       fallback=config.port == DEFAULT_PORT)
    supervisor.listeners.append(web.broker)
    supervisor.journal.set_meta(web_url=web.url)
    supervisor.tickers.append(lambda: _watch(supervisor, web))
    moved = ""
    if config.port == DEFAULT_PORT and not web.url.endswith(f":{DEFAULT_PORT}/"):
        moved = f" (port {DEFAULT_PORT} is in use)"
    print(f"[oomguard] dashboard: {web.url}{moved}; control token in {supervisor.run_dir / TOKEN_NAME}",
          file=sys.stderr, flush=True)
    if not is_loopback(config.host):
        print(f"[oomguard] WARNING: the dashboard listens on {config.host}, reachable from the network; every "
              f"request needs the token. Open {_exposed_link(config.host, web)} once in your browser "
              "(it keeps the token as a cookie); do not share that link", file=sys.stderr, flush=True)
    return web


def _watch(supervisor: Supervisor, web: WebServer) -> None:
    """The dashboard's thread ending on its own is a degradation (said once); supervision goes on."""
    if not web.thread.is_alive() and not web.server.should_exit:
        supervisor.degradations.failed("web", "the dashboard server stopped; the run goes on without it")


def _exposed_link(host: str, web: WebServer) -> str:
    name = socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
    port = web.url.rstrip("/").rsplit(":", 1)[1]
    return (f"http://[{name}]:{port}/" if ":" in name else f"http://{name}:{port}/") + f"?token={web.token}"


def stop_dashboard(supervisor: Supervisor, web: WebServer) -> None:
    if web.broker in supervisor.listeners:
        supervisor.listeners.remove(web.broker)
    with contextlib.suppress(sqlite3.Error):  # the journal may already be closed
        supervisor.journal.set_meta(web_url=None)
    web.stop()
