"""Webhook notifications: a run gave up, succeeded, or recovered from an OOM.

Supervision never waits on the network: ``WebhookNotifier.send()`` puts the notification on a bounded
queue and returns; one background thread POSTs it to every configured webhook with a timeout and
retries (exponential backoff on connection errors, timeouts, 429 and 5xx). When the queue is full
the notification is dropped and counted, never blocking the caller.

Body formats, chosen per webhook (``FORMAT=URL`` on the command line, plain ``URL`` for json):

- ``json``: ``{"event", "run", "title", "message", "time", "details"}``, for your own receiver;
- ``slack``: ``{"text": ...}``, which Slack incoming webhooks (and Mattermost, Discord's
  ``/slack`` endpoint) accept;
- ``ntfy``: the topic URL (``https://ntfy.sh/mytopic``) is split into server and topic and the
  notification is published as ntfy's JSON (``{"topic", "title", "message", "tags", "priority"}``).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from oomguard.supervisor.errors import UsageError

log = logging.getLogger(__name__)

FAILED = "failed"  # the supervisor gave up
SUCCEEDED = "succeeded"
RECOVERED = "recovered"  # a memory failure was handled and the run goes on
WARNING = "warning"  # the run goes on, but is wired so that it loses work (a resume that did not happen)
EVENTS = (FAILED, SUCCEEDED, RECOVERED, WARNING)
FORMATS = ("json", "slack", "ntfy")

_EMOJI = {FAILED: ":x:", SUCCEEDED: ":white_check_mark:", RECOVERED: ":recycle:", WARNING: ":warning:"}
_NTFY = {FAILED: (["x"], 5), SUCCEEDED: (["white_check_mark"], 3), RECOVERED: (["recycle"], 3),
         WARNING: (["warning"], 4)}
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class NotifyConfigError(UsageError):
    """A bad webhook setting; the message is one line naming the option and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)


@dataclass(frozen=True)
class Webhook:
    url: str
    format: str = "json"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise NotifyConfigError(
                f"--notify format {self.format!r} is unknown: use one of {', '.join(FORMATS)}"
            )
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise NotifyConfigError(f"--notify URL {self.url!r} must be an http:// or https:// URL")
        if self.format == "ntfy" and not parts.path.strip("/"):
            raise NotifyConfigError(f"--notify ntfy URL {self.url!r} needs a topic: https://ntfy.sh/TOPIC")


@dataclass(frozen=True)
class NotifyConfig:
    webhooks: tuple[Webhook, ...] = ()
    timeout_s: float = 5.0  # per request
    retries: int = 3  # further tries after the first
    backoff_s: float = 1.0  # doubled after each failed try
    queue_size: int = 64
    events: frozenset[str] = frozenset(EVENTS)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise NotifyConfigError("--notify-timeout must be a positive number of seconds")
        if self.retries < 0:
            raise NotifyConfigError("--notify-retries must be 0 or more")
        if self.queue_size < 1:
            raise NotifyConfigError("notify queue_size must be at least 1")
        unknown = set(self.events) - set(EVENTS)
        if unknown:
            raise NotifyConfigError(f"--notify-on {sorted(unknown)} unknown: use {', '.join(EVENTS)}")


def parse_webhook(spec: str) -> Webhook:
    """``https://...`` (json) or ``slack=https://...`` / ``ntfy=https://ntfy.sh/topic``."""
    head, sep, rest = spec.partition("=")
    if sep and head in FORMATS and "://" not in head:
        return Webhook(url=rest, format=head)
    return Webhook(url=spec)


@dataclass(frozen=True)
class Notification:
    event: str
    run: str
    title: str
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


def gave_up(run: str, reason: str, **details: Any) -> Notification:
    return Notification(FAILED, run, f"oomguard: {run} failed", reason, details)


def succeeded(run: str, summary: str, **details: Any) -> Notification:
    return Notification(SUCCEEDED, run, f"oomguard: {run} finished", summary, details)


def recovered(
    run: str, kind: str, old_micro: int, new_micro: int, grad_accum: int, **details: Any
) -> Notification:
    message = f"{kind} at micro-batch {old_micro}; restarting at {new_micro} x {grad_accum} accumulation"
    return Notification(RECOVERED, run, f"oomguard: {run} recovered from {kind}", message, details)


def warning(run: str, message: str, **details: Any) -> Notification:
    return Notification(WARNING, run, f"oomguard: {run} is losing work", message, details)


def render_body(hook: Webhook, note: Notification) -> tuple[str, dict[str, Any]]:
    """The URL to POST to and the JSON body for ``note`` in ``hook``'s format."""
    if hook.format == "slack":
        return hook.url, {"text": f"{_EMOJI.get(note.event, '')} *{note.title}*\n{note.message}".strip()}
    if hook.format == "ntfy":
        return _ntfy_body(hook.url, note)
    stamp = datetime.fromtimestamp(note.time, tz=timezone.utc).isoformat()
    body = {"event": note.event, "run": note.run, "title": note.title, "message": note.message}
    return hook.url, {**body, "time": stamp, "details": dict(note.details)}


def _ntfy_body(topic_url: str, note: Notification) -> tuple[str, dict[str, Any]]:
    parts = urlsplit(topic_url)
    base, _, topic = parts.path.strip("/").rpartition("/")
    server = urlunsplit((parts.scheme, parts.netloc, f"/{base}" if base else "/", "", ""))
    tags, priority = _NTFY.get(note.event, ([], 3))
    return server, {
        "topic": topic,
        "title": note.title,
        "message": note.message,
        "tags": tags,
        "priority": priority,
    }


class WebhookNotifier:
    """Delivers notifications from a background thread; ``send()`` never blocks."""

    def __init__(self, config: NotifyConfig) -> None:
        self.config = config
        self._queue: queue.Queue[Notification | None] = queue.Queue(maxsize=config.queue_size)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.delivered = 0  # (notification, webhook) pairs that got a 2xx
        self.failed = 0  # pairs that ran out of tries
        self.dropped = 0  # notifications the full queue refused
        self._thread = threading.Thread(target=self._run, name="oomguard-notify", daemon=True)
        self._started = False

    @property
    def enabled(self) -> bool:
        return bool(self.config.webhooks)

    def send(self, note: Notification) -> bool:
        """Queue ``note`` for delivery; False when disabled, filtered out, or the queue is full."""
        if not self.enabled or note.event not in self.config.events or self._stop.is_set():
            return False
        self._ensure_started()
        try:
            self._queue.put_nowait(note)
        except queue.Full:
            with self._lock:
                self.dropped += 1
            log.warning("notification queue full; dropped %s for %s", note.event, note.run)
            return False
        return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Deliver what is queued within ``timeout_s``, then stop; True when everything went out."""
        if not self._started:
            return True
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("notification queue still full at close; abandoning what is left")
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()  # abandons any backoff still waiting
        self._thread.join(max(1.0, self.config.timeout_s))
        return not self._thread.is_alive() and self._queue.empty()

    def _ensure_started(self) -> None:
        with self._lock:
            if not self._started:
                self._thread.start()
                self._started = True

    def _run(self) -> None:
        while True:
            note = self._queue.get()
            if note is None:
                return
            for hook in self.config.webhooks:
                ok = self._deliver(hook, note)
                with self._lock:
                    if ok:
                        self.delivered += 1
                    else:
                        self.failed += 1

    def _deliver(self, hook: Webhook, note: Notification) -> bool:
        url, body = render_body(hook, note)
        delay = self.config.backoff_s
        for attempt in range(self.config.retries + 1):
            retry, reason = post_json(url, body, self.config.timeout_s)
            if reason is None:
                return True
            log.warning("webhook %s try %d: %s", _redact(url), attempt + 1, reason)
            if not retry or self._stop.wait(delay):
                return False
            delay *= 2
        return False


def post_json(url: str, body: Mapping[str, Any], timeout_s: float) -> tuple[bool, str | None]:
    """POST ``body``; (retry?, None) on 2xx, else (whether a retry may help, the reason)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(  # the scheme is checked in Webhook
        url, data=data, method="POST", headers={"Content-Type": "application/json", "User-Agent": "oomguard"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as error:
        return error.code in _RETRY_STATUS, f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:  # refused, DNS, timeout
        return True, str(getattr(error, "reason", error))
    return False, None


def _redact(url: str) -> str:
    # Webhook URLs carry their secret in the path (Slack's /services/T/B/XXXX): log the host only.
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/..."
