"""Notifications: a run gave up, succeeded, recovered from an OOM, found a leak, or degraded.

Where they go is a URL per service, read by Apprise (the library the self-hosting world uses for
100+ services): ``tgram://``, ``discord://``, ``mailto://``, ``ntfys://``, ``slack://``,
``json://`` and the rest, and the ``https://`` URLs services hand out themselves (a Slack, Discord or
Mattermost webhook). A plain ``http(s)://`` URL that no service claims is a generic webhook, as
before Apprise: oomguard POSTs its own JSON there, ``{"event", "run", "title", "message", "time",
"details"}``. The older ``slack=URL`` and ``ntfy=URL`` forms are read as the Apprise URLs they mean.

Supervision never waits on the network: ``Notifier.send()`` puts the notification on each target's
bounded queue and returns. Each target has its own thread (a dead Telegram never delays Discord),
which tries, and after a failure tries again with exponential backoff; a target that still fails is
a degradation (``notify tgram://… degraded: …``), said once and shown by ``oomguard status``, and its
next delivery says it recovered. A full queue drops the notification and counts it.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.record import memoryparts
from oomguard.supervisor.record.journal import Degradations

if TYPE_CHECKING:
    from apprise.plugins.base import NotifyBase

FAILED = "failed"  # the supervisor gave up
SUCCEEDED = "succeeded"
RECOVERED = "recovered"  # a memory failure was handled and the run goes on
LEAK = "leak"  # memory kept rising while training went on: restarted from the newest checkpoint
DEGRADED = "degraded"  # one of oomguard's own parts (journal, logs, dashboard…) is failing; the worker runs
WARNING = "warning"  # the run goes on, but is wired so that it loses work (a resume that did not happen)
EVENTS = (FAILED, SUCCEEDED, RECOVERED, LEAK, DEGRADED, WARNING)
LEGACY_FORMATS = ("json", "slack", "ntfy")  # the ``FORMAT=URL`` forms of the first --notify
COMPONENT = "notify"  # the degradations of one target are "notify <its redacted URL>"
SERVICES_HINT = "see `apprise --details` or Apprise's wiki for each service's URL"


class NotifyConfigError(UsageError):
    """A bad --notify setting; the message is one line naming the option and the fix."""

    def __init__(self, problem: str, fix: str = SERVICES_HINT) -> None:
        super().__init__("--notify", problem, fix)


# --- what is sent ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Notification:
    event: str
    run: str
    title: str
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    @property
    def body(self) -> str:
        """The text a person reads: what happened, then where (a machine may run several jobs)."""
        attempt = self.details.get("attempt")
        return f"{self.message}\n{self.run} on {socket.gethostname()}" + (f", attempt {attempt}" if attempt else "")


def gave_up(run: str, reason: str, **details: Any) -> Notification:
    return Notification(FAILED, run, f"oomguard: {run} failed", reason, details)


def succeeded(run: str, summary: str, **details: Any) -> Notification:
    return Notification(SUCCEEDED, run, f"oomguard: {run} finished", summary, details)


def recovered(run: str, kind: str, old_micro: int, new_micro: int, grad_accum: int, why: str | None = None,
              memory: str | None = None, **details: Any) -> Notification:
    """``why``: the attribution's summary, with its figures (why the batch was, or was not, to blame);
    ``memory``: what filled memory at the failure (``memory_line``)."""
    message = (f"{kind} at micro-batch {old_micro}; restarting at {new_micro} x {grad_accum} accumulation"
               + (f"\ncause: {why}" if why else "") + (f"\nmemory: {memory}" if memory else ""))
    return Notification(RECOVERED, run, f"oomguard: {run} recovered from {kind}", message, details)


class FailureMemory:
    """The ``memory_breakdown`` events of the failure being handled (one per rank), until its
    decision takes them as one line (the peak of an attempt that fit is no failure's)."""

    def __init__(self) -> None:
        self.events: list[Mapping[str, Any]] = []

    def heard(self, name: str, data: Mapping[str, Any]) -> bool:
        if name != memoryparts.EVENT:
            return False
        if data.get("at") != "peak":
            self.events.append(data)
        return True

    def take(self) -> str | None:
        line, self.events = memory_line(self.events), []
        return line


def memory_line(breakdowns: Sequence[Mapping[str, Any]]) -> str | None:
    """One short line of what filled memory at a failure, from its ``memory_breakdown`` events (one
    per rank): the fullest rank's parts and limit (record/memoryparts.py), or None without one."""
    values = [v for v in (memoryparts.parse(data) for data in breakdowns) if v is not None]
    if not values:
        return None
    fullest = memoryparts.fullest(values)
    rank = f"rank {fullest.rank}: " if fullest.rank is not None and len(values) > 1 else ""
    return rank + memoryparts.parts_text(fullest)


def leak(run: str, reason: str, **details: Any) -> Notification:
    return Notification(LEAK, run, f"oomguard: {run} has a memory leak", reason, details)


def warning(run: str, message: str, **details: Any) -> Notification:
    return Notification(WARNING, run, f"oomguard: {run} is losing work", message, details)


def degraded(run: str, component: str, problem: str, **details: Any) -> Notification:
    return Notification(DEGRADED, run, f"oomguard: {run}: {component} degraded",
                        f"{component}: {problem}; the worker keeps running", details)


# --- where it goes --------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One --notify URL: an Apprise URL, or a plain http(s) webhook that gets oomguard's own JSON."""

    url: str
    apprise: bool

    @property
    def shown(self) -> str:
        """The URL without its secrets (tokens live in the path or the user part), for log lines."""
        if self.apprise:
            return str(_plugin(self.url).url(privacy=True)).split("?", 1)[0]
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}/…"


def parse_target(spec: str) -> Target:
    """``URL`` (Apprise's, or a plain webhook), or the older ``slack=URL``, ``ntfy=URL``, ``json=URL``."""
    head, sep, rest = spec.partition("=")
    if sep and head in LEGACY_FORMATS and "://" not in head:
        return _legacy(head, rest)
    parts = urlsplit(spec)
    scheme = parts.scheme.lower()
    if not scheme or "://" not in spec:
        raise NotifyConfigError(f"{spec!r} is not a URL", "give a service URL such as tgram://BOT_TOKEN/CHAT_ID, "
                                "discord://ID/TOKEN or a plain https:// webhook")
    if _claimed(spec):
        return Target(spec, apprise=True)
    if scheme in ("http", "https"):
        if not parts.hostname:
            raise NotifyConfigError(f"{spec!r} has no host", "e.g. https://example.org/hook")
        return Target(spec, apprise=False)  # no service claims it: a generic webhook
    raise NotifyConfigError(f"{_no_secrets(spec)!r} is not a URL Apprise can use (unknown service or missing "
                            "token)")


def _legacy(fmt: str, url: str) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NotifyConfigError(f"{fmt}={url!r}: the URL must be http:// or https://", f"e.g. {fmt}=https://…")
    if fmt == "json":
        return Target(url, apprise=False)
    if fmt == "ntfy":
        if not parts.path.strip("/"):
            raise NotifyConfigError(f"ntfy={url!r} needs a topic", "e.g. ntfy=https://ntfy.sh/TOPIC")
        scheme = "ntfys" if parts.scheme == "https" else "ntfy"
        return parse_target(urlunsplit((scheme, parts.netloc, parts.path, parts.query, "")))
    if not _claimed(url):  # slack=: Slack's (and Mattermost's) webhook URLs are Apprise's too
        raise NotifyConfigError(f"slack={_no_secrets(url)!r} is not a Slack webhook URL Apprise recognises",
                                "give the Apprise URL instead: slack://TOKEN_A/TOKEN_B/TOKEN_C or mmost://HOST/TOKEN")
    return Target(url, apprise=True)


def _no_secrets(url: str) -> str:
    """Services keep tokens in the host part too (tgram://BOT_TOKEN/…): only a web address shows its host."""
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        return f"{parts.scheme}://{parts.hostname or ''}/…"
    return f"{parts.scheme}://…" if parts.scheme else "…"


_plugins: dict[str, NotifyBase] = {}
_plugins_lock = threading.Lock()


def _plugin(url: str) -> NotifyBase:
    """Apprise's object for ``url`` (instantiated once: the first costs Apprise's plugin scan)."""
    with _plugins_lock:
        if url not in _plugins:
            import apprise

            plugin = apprise.Apprise.instantiate(url, suppress_exceptions=True)
            if plugin is None:
                raise NotifyConfigError(f"{_no_secrets(url)!r} is not a URL Apprise can use")
            _plugins[url] = plugin
        return _plugins[url]


def _claimed(url: str) -> bool:
    try:
        with _apprise_log():
            _plugin(url)
    except NotifyConfigError:
        return False
    return True


# --- delivering -----------------------------------------------------------------------------


def deliver(target: Target, note: Notification, timeout_s: float) -> str | None:
    """One try: None when the service took it, else why not (one line)."""
    if not target.apprise:
        return post_json(target.url, webhook_body(note), timeout_s)
    import apprise

    plugin = _plugin(target.url)
    plugin.socket_connect_timeout = plugin.socket_read_timeout = timeout_s
    warn = apprise.NotifyType.WARNING
    kind = {FAILED: apprise.NotifyType.FAILURE, SUCCEEDED: apprise.NotifyType.SUCCESS, LEAK: warn, DEGRADED: warn,
            WARNING: warn}.get(note.event, apprise.NotifyType.INFO)
    with _apprise_log() as said:
        try:
            ok = plugin.notify(body=note.body, title=note.title, notify_type=kind)
        except Exception as exc:  # a plugin's bug is this target failing, never the lane's end
            return f"{type(exc).__name__}: {exc}"
    return None if ok else (said[-1] if said else "the service did not accept it")


def webhook_body(note: Notification) -> dict[str, Any]:
    """oomguard's own JSON, for plain webhooks."""
    stamp = datetime.fromtimestamp(note.time, tz=timezone.utc).isoformat()
    return {"event": note.event, "run": note.run, "title": note.title, "message": note.message, "time": stamp,
            "details": dict(note.details)}


def post_json(url: str, body: Mapping[str, Any], timeout_s: float) -> str | None:
    """POST ``body`` as JSON; None on 2xx, else the reason."""
    request = urllib.request.Request(url, data=json.dumps(body, default=str).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "oomguard"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code} {error.reason}"
    except (urllib.error.URLError, OSError) as error:  # refused, DNS, timeout
        return str(getattr(error, "reason", error))
    return None


class _Said(logging.Handler):
    """Apprise says why a delivery failed in its log; keep this thread's warnings as the reason."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.lines.append((record.getMessage().splitlines() or [""])[0])


@contextmanager
def _apprise_log() -> Iterator[list[str]]:
    """Apprise's warnings while delivering, as reasons, not as lines on the supervisor's console."""
    logger = logging.getLogger("apprise")
    handler = _Said()
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


# --- the background delivery ------------------------------------------------------------------


@dataclass(frozen=True)
class NotifyConfig:
    targets: tuple[Target, ...] = ()
    timeout_s: float = 10.0  # per try
    retries: int = 3  # further tries after the first
    backoff_s: float = 2.0  # before the first retry; doubled after each
    queue_size: int = 64  # per target
    events: frozenset[str] = frozenset(EVENTS)

    def __post_init__(self) -> None:
        for bad, problem in ((self.timeout_s <= 0, "the delivery timeout must be a positive number of seconds"),
                             (self.retries < 0, "retries must be 0 or more"),
                             (self.queue_size < 1, "the queue must hold at least 1 notification")):
            if bad:
                raise NotifyConfigError(problem, "")
        if unknown := set(self.events) - set(EVENTS):
            raise NotifyConfigError(f"events {sorted(unknown)} unknown", f"use {', '.join(EVENTS)}")


class _Lane:
    """One target's queue and thread."""

    def __init__(self, target: Target, config: NotifyConfig, health: Degradations | None,
                 stop: threading.Event) -> None:
        self.target = target
        self.config = config
        self.health = health
        self.stop = stop
        self.queue: queue.Queue[Notification | None] = queue.Queue(maxsize=config.queue_size)
        self.delivered = self.failed = self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="oomguard-notify", daemon=True)
        self.component = f"{COMPONENT} {target.shown}"

    def _run(self) -> None:
        while (note := self.queue.get()) is not None:
            why, tries = self._try_with_backoff(note)
            if why is None:
                self.delivered += 1
                if self.health is not None:
                    self.health.recovered(self.component)
            else:
                self.failed += 1
                if self.health is not None:
                    self.health.failed(self.component, why, unit="notifications",
                                       what=f" ({tries} {'try' if tries == 1 else 'tries'})")

    def _try_with_backoff(self, note: Notification) -> tuple[str | None, int]:
        """(None, tries) once delivered, else (the last reason, tries); closing ends the backoff early."""
        tries, delay = 0, self.config.backoff_s
        while True:
            tries += 1
            why = deliver(self.target, note, self.config.timeout_s)
            if why is None or tries > self.config.retries or self.stop.wait(delay):
                return why, tries
            delay *= 2


class Notifier:
    """Delivers notifications from one background thread per target; ``send()`` never blocks."""

    def __init__(self, config: NotifyConfig, health: Degradations | None = None) -> None:
        self.config = config
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self.lanes = [_Lane(t, config, health, self._stop) for t in config.targets]

    @property
    def delivered(self) -> int:
        return sum(lane.delivered for lane in self.lanes)

    @property
    def failed(self) -> int:
        return sum(lane.failed for lane in self.lanes)

    @property
    def dropped(self) -> int:
        return sum(lane.dropped for lane in self.lanes)

    def send(self, note: Notification) -> bool:
        """Queue ``note`` for every target; False when none took it (disabled, filtered, queues full)."""
        if not self.lanes or note.event not in self.config.events or self._stop.is_set():
            return False
        with self._lock:
            if not self._started:
                for lane in self.lanes:
                    lane.thread.start()
                self._started = True
        taken = False
        for lane in self.lanes:
            try:
                lane.queue.put_nowait(note)
                taken = True
            except queue.Full:
                lane.dropped += 1
        return taken

    def close(self, timeout_s: float = 10.0) -> bool:
        """Deliver what is queued within ``timeout_s``, then stop; True when everything went out."""
        if not self._started:
            return True
        deadline = time.monotonic() + timeout_s
        for lane in self.lanes:
            try:
                lane.queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                continue  # still full at the deadline: what is left is abandoned below
        for lane in self.lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()  # abandons any backoff still waiting
        for lane in self.lanes:
            lane.thread.join(1.0)
        return all(not lane.thread.is_alive() and lane.queue.empty() for lane in self.lanes)


def notify_config(specs: Sequence[str], **settings: Any) -> NotifyConfig:
    return NotifyConfig(targets=tuple(parse_target(s) for s in specs), **settings)


# --- oomguard notify-test -------------------------------------------------------------------


def _cmd_notify_test(args: argparse.Namespace, command: Sequence[str]) -> int:
    targets = [parse_target(spec) for spec in args.urls]  # all checked before anything is sent
    note = Notification("test", "notify-test", "oomguard: test notification",
                        "If you can read this, oomguard's notifications reach you here.")
    failures = 0
    for target in targets:
        started = time.monotonic()
        why = deliver(target, note, args.timeout)
        took = f"{time.monotonic() - started:.2f} s"
        if why is None:
            print(f"sent to {target.shown} ({took})")
        else:
            failures += 1
            print(f"failed: {target.shown}: {why} ({took})")
    return 1 if failures else 0


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be above 0")
    return value


def add_notify_test_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("notify-test", help="send one test notification to each URL, as --notify would")
    parser.add_argument("urls", nargs="+", metavar="URL", help="an Apprise URL (tgram://, discord://, mailto://, "
                        "ntfys://, slack://, json://…) or a plain https:// webhook")
    parser.add_argument("--timeout", type=_timeout, default=10.0, metavar="SECONDS",
                        help="how long to wait for each service (default: 10)")
    parser.set_defaults(func=_cmd_notify_test)
