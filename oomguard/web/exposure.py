"""Who may reach the dashboard, and how much of the process it may take.

Tested in tests/e2e/faults/test_exposure.py.

* On a loopback bind (``127.0.0.0/8``, ``::1``, ``localhost``) every request's ``Host`` must be a
  loopback name too: a web page elsewhere cannot use DNS rebinding to read the run.
* On any other bind the network can reach it, so reads need the token as well as control does:
  ``Authorization: Bearer TOKEN``, or the cookie a browser gets by opening the link oomguard prints
  once at start (``/?token=TOKEN`` sets it, HttpOnly and SameSite=Strict, and redirects to ``/``).
  Control endpoints still take the bearer header only, so a cookie can never stop a run.
  ``/healthz`` alone answers without the token, since Docker's HEALTHCHECK and Kubernetes probes carry
  none; such a caller learns only whether the server and its supervisor are up, not the run's state.
* Connections are bounded by the file descriptors there are: ``RESERVE`` stay for supervision
  (journal, logs, cgroup files, the next worker's pipes); past the cap a new connection is closed
  as soon as it is accepted, and one that sends no request within ``FIRST_REQUEST_TIMEOUT`` is closed.

Also here:

- The addresses a dashboard is reached at: from this machine, and from elsewhere.
- Secret-looking arguments and environment values, hidden from what the dashboard serves.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import re
import resource
import socket
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs

import psutil
from uvicorn.protocols.http.auto import AutoHTTPProtocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

COOKIE = "oomguard_token"
RESERVE = 64  # file descriptors kept for supervision whatever the dashboard's load
BACKLOG = 32  # accepted per wake-up by asyncio: the most that exist before the cap can close them
MAX_CONNECTIONS = 200
MIN_CONNECTIONS = 4
FIRST_REQUEST_TIMEOUT = 10.0  # seconds a connection may stay open without sending a request
PUBLIC_PREFIXES = ("/static/",)  # the page's own scripts and styles: nothing of the run is in them
PROBE_PATH = "/healthz"  # liveness for probes that carry no token
ANONYMOUS = "oomguard.anonymous"  # set in the scope of a probe let through without the token


def is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The name in a ``Host`` header, without its port: ``[::1]:8765`` -> ``::1``."""
    header = header.strip()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def connection_cap(reserve: int = RESERVE) -> int:
    """How many dashboard connections this process can afford under its RLIMIT_NOFILE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 32
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, soft - reserve - BACKLOG - in_use))


def bounded_protocol(cap: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, closing connections past ``cap`` and those that never send a request."""

    class Bounded(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > cap:
                transport.abort()  # the fd is freed now; the client sees a reset and may retry
                return
            self._first = self.loop.call_later(FIRST_REQUEST_TIMEOUT, self._drop_if_silent)

        def data_received(self, data: bytes) -> None:
            first = getattr(self, "_first", None)
            if first is not None:
                first.cancel()
                self._first = None
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            first = getattr(self, "_first", None)
            if first is not None:
                first.cancel()
            super().connection_lost(exc)

        def _drop_if_silent(self) -> None:
            self._first = None
            if not self.transport.is_closing():
                self.transport.close()

    return Bounded


def guard(app: ASGIApp, bind_host: str, token: str) -> ASGIApp:
    """The app behind the check that fits the bind: Host names on loopback, the token elsewhere."""
    return _LoopbackHosts(app) if is_loopback(bind_host) else _ReadToken(app, token)


class _LoopbackHosts:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not is_loopback(host_of(_header(scope, b"host"))):
            await _plain(send, 400, b"Invalid host header")
            return
        await self.app(scope, receive, send)


class _ReadToken:
    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    def _ok(self, offered: str) -> bool:
        return bool(offered) and hmac.compare_digest(offered.encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(PUBLIC_PREFIXES):
            await self.app(scope, receive, send)
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
        if scope["path"] == "/" and self._ok(query):  # the printed link: keep it as a cookie, drop it from the URL
            await send({"type": "http.response.start", "status": 303, "headers": [
                (b"location", b"/"), (b"cache-control", b"no-store"),
                (b"set-cookie", f"{COOKIE}={query}; HttpOnly; SameSite=Strict; Path=/".encode())]})
            await send({"type": "http.response.body", "body": b""})
            return
        bearer = _header(scope, b"authorization")
        offered = bearer[7:] if bearer.lower().startswith("bearer ") else _cookie(scope)
        if not self._ok(offered):
            if scope["path"] == PROBE_PATH:
                await self.app({**scope, ANONYMOUS: True}, receive, send)
                return
            await _plain(send, 401, b'{"detail": "this dashboard listens on a network address: open the link '
                         b'with the token that oomguard printed at start, or send Authorization: Bearer '
                         b'(the token is in RUN_DIR/token)"}', b"application/json")
            return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return ""


def _cookie(scope: Scope) -> str:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(_header(scope, b"cookie"))
    except Exception:  # a malformed Cookie header is no token
        return ""
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else ""


async def _plain(send: Send, status: int, body: bytes, kind: bytes = b"text/plain") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# The addresses a dashboard is reached at: from this machine, and from elsewhere.
#
# On a wildcard bind (``--host 0.0.0.0``) the first link printed used to be ``http://127.0.0.1:PORT/``
# (which answers 401 there, since a network bind needs the token) and the token link named
# ``localhost`` (``socket.getfqdn()`` on a machine whose hosts file maps its name to 127.0.1.1): neither
# opens from another machine. The links others use are the machine's host name and its non-loopback
# interface addresses (psutil), or the address the user bound to.


WILDCARDS = ("0.0.0.0", "::", "")


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def local_url(host: str, port: int) -> str:
    """Where clients on this machine reach a server bound to ``host``."""
    return url("127.0.0.1" if host in WILDCARDS else host, port)


def public_urls(host: str, port: int) -> list[str]:
    """Where a person on another machine opens it: the address bound to, or for a wildcard bind
    the machine's name and each non-loopback address it has (IPv6 too for ``::``)."""
    if host not in WILDCARDS:
        return [url(host, port)]
    names = [name] if (name := socket.gethostname()) and not _loopback_name(name) else []
    families = (socket.AF_INET, socket.AF_INET6) if host == "::" else (socket.AF_INET,)
    try:
        interfaces = psutil.net_if_addrs()
    except OSError:
        interfaces = {}
    for addresses in interfaces.values():
        for address in addresses:
            if address.family in families and _reachable(address.address.split("%")[0]):
                names.append(address.address.split("%")[0])
    return [url(name, port) for name in dict.fromkeys(names)] or [local_url(host, port)]


def _loopback_name(name: str) -> bool:
    return name.lower().startswith("localhost") or _is_ip(name) and not _reachable(name)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _reachable(text: str) -> bool:
    """An address another machine may reach: not loopback, link-local or unspecified."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


# Secret-looking arguments and environment values, hidden from what the dashboard serves.
#
# The dashboard shows the training command and streams the worker's log; on a shared machine or a
# network bind, ``--api-key sk-...`` or ``HF_TOKEN=...`` in either would be read by whoever can reach
# it. ``argv`` hides the value after (or in) a secret-looking option and in ``NAME=value`` words with a
# secret-looking name; ``text`` does the same inside free text (log lines).


HIDDEN = "***"
# Names that hold secrets by convention: API_KEY, HF_TOKEN, WANDB_API_KEY, DB_PASSWORD, --secret ...
# A name ending in key/token/auth/credential(s)/passphrase (not --tokenizer), or holding secret/password.
_SECRET_NAME = r"[A-Za-z0-9_.-]*(?:key|token|auth|credentials?|passphrase|(?:secret|passw(?:or)?d)[A-Za-z0-9_.-]*)"
_OPTION = re.compile(rf"^--?{_SECRET_NAME}$", re.IGNORECASE)
_OPTION_EQ = re.compile(rf"^(--?{_SECRET_NAME}=)(.+)$", re.IGNORECASE)
_ASSIGN = re.compile(rf"^({_SECRET_NAME}=)(.+)$", re.IGNORECASE)
# Environment-style NAME=value (upper case): the word anywhere in the name, e.g. AWS_ACCESS_KEY_ID.
_ENV_NAME = r"[A-Z0-9_]*(?:KEY|TOKEN|SECRET|PASSW(?:OR)?D|CREDENTIAL|AUTH)[A-Z0-9_]*"
_ENV = re.compile(rf"^({_ENV_NAME}=)(.+)$")
_ENV_IN_TEXT = re.compile(rf"(\b{_ENV_NAME}=)(\"[^\"]*\"|'[^']*'|[^\s;,&]+)")
_IN_TEXT = re.compile(rf"((?:--?{_SECRET_NAME}(?:=|\s+))|(?:\b{_SECRET_NAME}(?:=|:\s*)))(\"[^\"]*\"|'[^']*'|[^\s;,&]+)",
                      re.IGNORECASE)


def argv(words: Sequence[str]) -> list[str]:
    out: list[str] = []
    hide_next = False
    for word in words:
        if hide_next and not word.startswith("-"):
            out.append(HIDDEN)
            hide_next = False
            continue
        hide_next = bool(_OPTION.match(word))
        match = _OPTION_EQ.match(word) or _ASSIGN.match(word) or _ENV.match(word)
        out.append(match.group(1) + HIDDEN if match else text(word))  # text(): a script in one word
    return out


def text(line: str) -> str:
    if _IN_TEXT.search(line):
        line = _IN_TEXT.sub(lambda m: m.group(1) + HIDDEN, line)
    if _ENV_IN_TEXT.search(line):
        line = _ENV_IN_TEXT.sub(lambda m: m.group(1) + HIDDEN, line)
    return line


def status(doc: dict[str, Any]) -> dict[str, Any]:
    if isinstance(doc.get("command"), list):
        doc = {**doc, "command": argv(doc["command"])}
    return doc
