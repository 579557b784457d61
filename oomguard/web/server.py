"""The dashboard's server: uvicorn in a background thread of the supervisor process.

Tested in tests/e2e/web/test_web_server.py.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.record.journal import write_atomic
from oomguard.supervisor.record.logs import say
from oomguard.web.app import Control, create_app
from oomguard.web.exposure import BACKLOG, bounded_protocol, connection_cap, guard, is_loopback, local_url, public_urls
from oomguard.web.journals import ChangeBroker

if TYPE_CHECKING:
    from oomguard.supervisor.run.loop import Supervisor

DEFAULT_PORT = 8765
TOKEN_NAME = "token"
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0
DRAIN_TIMEOUT = 1.0  # at most this long, open pages are sent the final state before the server goes
RESTART_FIRST = 2.0  # seconds before a crashed dashboard is started again; doubled on each failure
RESTART_MAX = 300.0


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
    sock: socket.socket  # the listening socket: closed here, since a crashed server may not have
    ended: list[BaseException] = field(default_factory=list)  # what the server thread died of
    public: list[str] = field(default_factory=list)  # on a network bind: where others open it (addresses.py)

    @property
    def port(self) -> int:
        return int(self.url.rstrip("/").rsplit(":", 1)[1])

    @property
    def crashed(self) -> bool:
        """The thread ended without being asked to."""
        return not self.thread.is_alive() and not self.server.should_exit

    def stop(self, timeout: float = STOP_TIMEOUT, why: str | None = None) -> None:
        """Close live streams (each sends the final state and ``why``), stop accepting once they
        have, let requests finish, then give up waiting (the thread is a daemon)."""
        self.broker.close(why)
        if not self.crashed:  # a dead server's streams have gone with it
            self.broker.wait_drained(DRAIN_TIMEOUT)
        self.server.should_exit = True
        self.thread.join(timeout / 2)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout / 2)
        self.sock.close()


def check_exposure(host: str, token: str | None) -> None:
    """Anyone who can reach a non-loopback address could stop the run: require a token there."""
    if not token and not is_loopback(host):
        raise UsageError("--host", f"refusing to serve the dashboard on {host} without a control token",
                         "bind to 127.0.0.1 (and use an SSH tunnel), or keep the token enabled")


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
    write_atomic(Path(run_dir) / TOKEN_NAME, token + "\n", 0o600)  # `oomguard stop` reads it whole
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
    ended: list[BaseException] = []
    thread = threading.Thread(target=_serve, args=(server, sock, ended), name="oomguard-web", daemon=True)
    thread.start()
    _wait_started(server, thread)
    return WebServer(server, thread, broker, local_url(host, sock.getsockname()[1]), token, sock, ended,
                     public_urls(host, sock.getsockname()[1]) if not is_loopback(host) else [])


def _serve(server: uvicorn.Server, sock: socket.socket, ended: list[BaseException]) -> None:
    """The thread's body: what ends it is kept for the degradation line, not printed as a traceback."""
    try:
        server.run(sockets=[sock])
    except BaseException as exc:  # whatever it was (uvicorn exits with SystemExit), the supervisor says it
        ended.append(exc)


def _wait_started(server: uvicorn.Server, thread: threading.Thread) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the dashboard server did not start")
        time.sleep(0.01)


class Dashboard:
    """The supervisor's dashboard, kept up. A server thread that ends on its own (a bug, a resource
    gone) is a degradation, said once, and is started again on the same port with the same token
    (bookmarks and cookies keep working), after RESTART_FIRST seconds and then backing off to
    RESTART_MAX; the run never waits on it. The loop calls ``tick`` every half second."""

    def __init__(self, supervisor: Supervisor, web: WebServer) -> None:
        self.supervisor = supervisor
        self.web = web
        self.restarts = 0
        self._delay = RESTART_FIRST
        self._retry_at: float | None = None
        self._attach()

    def _attach(self) -> None:
        self.supervisor.listeners.append(self.web.broker)
        self.supervisor.journal.set_meta(web_url=self.web.url, web_public=self.web.public)

    def _detach(self) -> None:
        if self.web.broker in self.supervisor.listeners:
            self.supervisor.listeners.remove(self.web.broker)
        with contextlib.suppress(sqlite3.Error):  # the journal may already be closed
            self.supervisor.journal.set_meta(web_url=None, web_public=[])

    def tick(self) -> None:
        if not self.web.crashed:
            return
        now = time.monotonic()
        if self._retry_at is None:
            self._detach()
            self.web.sock.close()
            why = f" ({type(self.web.ended[0]).__name__}: {self.web.ended[0]})" if self.web.ended else ""
            self.supervisor.degradations.failed("web", f"the dashboard server stopped{why}; the run goes on "
                                                f"without it, restarting it in {self._delay:g} s")
            self._retry_at = now + self._delay
            return
        if now < self._retry_at:
            return
        config = self.supervisor.config
        try:
            web = start_server(self.supervisor.run_dir, self.supervisor, config.web.host, self.web.port,
                               token=self.web.token)
        except (OSError, RuntimeError, UsageError):  # the port taken meanwhile, the thread dying again
            self._delay = min(self._delay * 2, RESTART_MAX)
            self._retry_at = now + self._delay
            return
        self.web, self.restarts, self._delay, self._retry_at = web, self.restarts + 1, RESTART_FIRST, None
        self._attach()
        self.supervisor.degradations.recovered("web")

    def stop(self) -> None:
        self._detach()
        self.web.stop(why="The supervisor has exited.")


def start_dashboard(supervisor: Supervisor) -> Dashboard:
    """Serve the supervisor's run: wake live streams on its events, record the URL for the CLI."""
    config = supervisor.config
    web = start_server(supervisor.run_dir, supervisor, config.web.host, config.web.port,
                       fallback=config.web.port == DEFAULT_PORT)
    dashboard = Dashboard(supervisor, web)
    supervisor.tickers.append(dashboard.tick)
    moved = ""
    if config.web.port == DEFAULT_PORT and not web.url.endswith(f":{DEFAULT_PORT}/"):
        moved = f" (port {DEFAULT_PORT} is in use)"
    say(f"dashboard: {_links(web.public) or web.url}{moved}; control token in {supervisor.run_dir / TOKEN_NAME}")
    if web.public:
        # A terminal is the user's own; a file (nohup, a Slurm or container log) may be read by others.
        shown = web.token if sys.stderr.isatty() else None
        say(_exposed(f"the dashboard listens on {config.web.host}", web.public, shown, supervisor.run_dir / TOKEN_NAME))
    return dashboard


def _links(public: list[str]) -> str:
    """``http://gpu7:8765/ (also http://10.0.0.7:8765/)``: the addresses others open."""
    return public[0] + (f" (also {', '.join(public[1:])})" if public[1:] else "") if public else ""


def _exposed(what: str, public: list[str], token: str | None, token_file: Path | None = None) -> str:
    """The warning with the link to open; without ``token`` (output that is not a terminal) the link
    names the token file (mode 0600) instead of the token."""
    if token is None:
        links = [f"{link}?token=TOKEN" for link in public]
        return (f"WARNING: {what}, reachable from the network; every request needs the token, which is in "
                f"{token_file} (readable by you only; not printed here, as this output is not a terminal). Open "
                f"{_links(links)} with TOKEN replaced by it once in your browser (it keeps the token as a cookie)")
    links = [f"{link}?token={token}" for link in public]
    return (f"WARNING: {what}, reachable from the network; every request needs the token. Open {_links(links)} "
            "once in your browser (it keeps the token as a cookie); do not share that link")


def stop_dashboard(supervisor: Supervisor, dashboard: Dashboard) -> None:
    if dashboard.tick in supervisor.tickers:
        supervisor.tickers.remove(dashboard.tick)
    dashboard.stop()


FLEET_PORT = 8760  # beside the runs' 8765, so neither takes the other's default


def serve_fleet(roots: list[Path], host: str, port: int, max_depth: int) -> int:
    """``oomguard dashboard``: serve the many-runs page in the foreground until Ctrl-C or SIGTERM
    (uvicorn's own signal handling: this process supervises nothing). Same rules as a run's
    dashboard: loopback by default, the token for every request on any other address."""
    from oomguard.web.fleet import Runs, create_fleet_app

    token = secrets.token_urlsafe(32)
    check_exposure(host, token)
    sock = bind(host, port, fallback=port == FLEET_PORT)
    app = create_fleet_app(Runs(roots, max_depth, guarded=not is_loopback(host)))
    cap = connection_cap()
    config = uvicorn.Config(guard(app, host, token), log_config=None, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2, lifespan="on", limit_concurrency=cap,
                            backlog=BACKLOG, http=bounded_protocol(cap))
    url = local_url(host, sock.getsockname()[1])
    public = public_urls(host, sock.getsockname()[1]) if not is_loopback(host) else []
    moved = f" (port {FLEET_PORT} is in use)" if port == FLEET_PORT and not url.endswith(f":{FLEET_PORT}/") else ""
    say(f"all runs under {', '.join(map(str, roots))}: {_links(public) or url}{moved}")
    if public:
        say(_exposed(f"listening on {host}", public, token))
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0
