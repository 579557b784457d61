"""What the supervisor tells the world as the run goes: systemd, notifications, the terminal status line.

Each hook subscribes to ``Supervisor.listeners`` (events) and ``Supervisor.tickers`` (every loop
tick); none of them can block or stop supervision (the loop catches their errors, notifications
are sent from their own threads, sd_notify is one datagram). Also here: the sd_notify protocol, and
the live status line beneath the worker's output with its journald-friendly twin.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.text import Text

from oomguard.supervisor.ops import notify
from oomguard.supervisor.record import logs
from oomguard.supervisor.run.runparts import WARNING_EVENTS
from oomguard.supervisor.units import GIB, format_size

if TYPE_CHECKING:
    from oomguard.supervisor.run.loop import Supervisor


# The sd_notify protocol: telling systemd that the supervisor is ready, what it does, and alive.
#
# A few ``KEY=value`` lines in one datagram to the AF_UNIX socket named by ``NOTIFY_SOCKET`` (a path,
# or ``@name`` for the abstract namespace). Without ``NOTIFY_SOCKET`` every call is a no-op, so the
# loop calls these unconditionally. A failed send is logged once and never stops supervision.
#
# Use from the loop::
#
#     notifier = SystemdNotifier.from_env()
#     watchdog = Watchdog.from_env(notifier)
#     notifier.ready("running attempt 1 at micro-batch 8")   # once the worker runs
#     while ...:
#         watchdog.tick()                                     # sends only when due
#         notifier.status("recovering: cuda_oom at micro 8 -> 4")
#     notifier.stopping()


log = logging.getLogger(__name__)

_STATUS_MAX = 200  # systemctl status shows one line; keep it short


class SystemdNotifier:
    """Sends sd_notify messages to one socket address; a no-op when the address is None."""

    def __init__(self, address: str | None) -> None:
        # "@name" is the abstract namespace: a leading NUL byte on the wire.
        self._address = (b"\0" + address[1:].encode() if address.startswith("@") else address) if address else None
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
            if not self._warned:  # systemd going away must not flood the log once per tick
                log.warning("sd_notify to %s failed: %s", os.environ.get("NOTIFY_SOCKET"), error)
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *_status_field(status))

    def status(self, text: str) -> bool:
        return self.send(*_status_field(text))

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *_status_field(status))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")


class Watchdog:
    """Pings systemd's watchdog at half of ``WATCHDOG_USEC``; ``tick()`` sends only when due."""

    def __init__(self, notifier: SystemdNotifier, interval_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._notifier = notifier
        self.interval_s = interval_s if notifier.enabled else None
        self._clock = clock
        self._next: float | None = None

    @classmethod
    def from_env(cls, notifier: SystemdNotifier, env: Mapping[str, str] = os.environ,
                 clock: Callable[[], float] = time.monotonic) -> Watchdog:
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


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Half of ``WATCHDOG_USEC`` in seconds, or None when the watchdog is off or meant for another PID."""
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2_000_000 if usec > 0 else None


def _status_field(text: str | None) -> list[str]:
    return [] if text is None else [f"STATUS={' '.join(text.split())[:_STATUS_MAX]}"]


MEMORY_KINDS = ("cuda_oom", "host_oom", "memory_limit")


def summary(sup: Supervisor) -> str:
    b = sup.plan.batch
    return (f"{sup.state.value}, attempt {sup.attempt}, micro-batch {b.micro_batch} × {b.grad_accum} "
            f"× {b.world_size} = {b.global_text}")


def attach_systemd(sup: Supervisor) -> None:
    notifier = SystemdNotifier.from_env()
    if not notifier.enabled:
        return
    watchdog = Watchdog.from_env(notifier)
    sup.tickers.append(watchdog.tick)
    ready = [False]

    def on_event(name: str, data: dict[str, Any]) -> None:
        if name != "state":
            return
        if data["to"] == "running" and not ready[0]:
            ready[0] = notifier.ready(summary(sup))
        elif data["to"] in ("succeeded", "failed", "stopped"):
            notifier.stopping(f"{data['to']}: {data['reason']}")
        else:
            notifier.status(summary(sup))

    sup.listeners.append(on_event)


def attach_notifications(sup: Supervisor) -> Callable[[], object] | None:
    """--notify: gave up, succeeded, recovered from an OOM, leak found, degraded (ops/notify.py)."""
    if not sup.config.notify.targets:
        return None
    sender = notify.Notifier(notify.notify_config(sup.config.notify.targets), health=sup.degradations)
    sup.listeners.append(_Notifications(sup, sender).on_event)
    run = sup.run_dir.name
    sup.tickers.append(_on_degradation(sup, lambda c, m: sender.send(notify.degraded(run, c, m, attempt=sup.attempt))))
    return lambda: sender.close(10.0)


class _Notifications:
    """What the run's events tell through --notify, and what must be remembered between them."""

    def __init__(self, sup: Supervisor, sender: notify.Notifier) -> None:
        self.sup, self.sender, self.run = sup, sender, sup.run_dir.name
        self.cause: dict[str, Any] = {}  # the newest attribution: its summary and the figures that decided it
        self.last_cause: dict[str, Any] | None = None  # the cause of the failure the run gave up after
        # a leak is told once (every restart it causes would say the same), and so is each kind of
        # wiring warning (a resume missed at every restart)
        self.told: set[str] = set()
        self.filled = notify.FailureMemory()  # what filled memory at the failure, told with its decision

    def on_event(self, name: str, data: dict[str, Any]) -> None:
        if name == "attribution":
            self.cause = dict(data)
        elif self.filled.heard(name, data):
            return
        elif name == "state":
            self._tell_end(data)
        elif name in WARNING_EVENTS and name not in self.told:
            self.told.add(name)
            self.sender.send(notify.warning(self.run, data["message"], attempt=self.sup.attempt))
        elif name == "planned_restart":
            self._leak(data, {})
        elif name == "decision":
            self._decision(data)

    def _decision(self, data: dict[str, Any]) -> None:
        cause, self.cause = self.cause, {}  # told with this decision; a later failure has its own
        memory, figures = self.filled.take(), {"cause": cause} if cause else {}
        if data["action"] == "give_up" and cause:
            self.last_cause = cause
        elif data["action"] == "restart" and data.get("cause") == "leak":
            self._leak(data, figures)
        elif data["action"] == "restart" and data["kind"] in MEMORY_KINDS:
            self.sender.send(notify.recovered(self.run, data["kind"], self.sup.plan.batch.micro_batch,
                                              data["micro_batch"], data["grad_accum"], cause.get("summary"), memory,
                                              evidence=data["evidence"], attempt=self.sup.attempt, **figures))

    def _tell_end(self, data: dict[str, Any]) -> None:
        """The run's end: gave up (with the cause of the failure it gave up after), or succeeded."""
        given = self.last_cause
        if data["to"] == "failed":
            reason = data["reason"]
            if given and given["summary"] not in reason:
                reason += f"\ncause: {given['summary']}"
            self.sender.send(notify.gave_up(self.run, reason, attempt=self.sup.attempt,
                                            **({"cause": given} if given else {})))
        elif data["to"] == "succeeded":
            self.sender.send(notify.succeeded(self.run, summary(self.sup), attempt=self.sup.attempt))

    def _leak(self, data: dict[str, Any], figures: dict[str, Any]) -> None:
        if "leak" not in self.told:
            self.told.add("leak")
            self.sender.send(notify.leak(self.run, data["reason"], attempt=self.sup.attempt, **figures))


def _on_degradation(sup: Supervisor, tell: Callable[[str, str], object]) -> Callable[[], None]:
    """A ticker telling each new degradation of oomguard's own parts once (not the notifier's own:
    those are said on the console, and the failing service would only be asked again)."""
    seen = [sup.degradations.version]
    told: set[str] = set()

    def tick() -> None:
        if sup.degradations.version == seen[0]:
            return
        seen[0] = sup.degradations.version
        active = {p["component"]: p["message"] for p in sup.degradations.active()}
        for component, message in active.items():
            if component not in told and not component.startswith(notify.COMPONENT + " "):
                tell(component, message)
        told.intersection_update(active)  # an ended one may be told again when it comes back
        told.update(active)

    return tick


def attach_statusline(sup: Supervisor) -> Callable[[], object] | None:
    """On a terminal only: a live line beneath the worker's output. Elsewhere the worker's bytes
    pass straight through and the supervisor's own log lines are the record."""
    if not sys.stdout.isatty():
        return None
    line = StatusLine(sys.stdout)

    def snapshot() -> dict[str, Any]:
        b = sup.plan.batch
        progress = sup.journal.meta().get("progress") or {}
        sample = sup.last_sample
        return {"state": sup.state.value, "attempt": sup.attempt, "micro_batch": b.micro_batch,
                "grad_accum": b.grad_accum, "world_size": b.world_size, "global_batch": b.global_batch,
                "asked_global_batch": b.asked,
                "host_bytes": sample.worker_rss_bytes if sample else None,
                "gpu_bytes": sample.worker_gpu_bytes if sample else None,
                "gpu_total_bytes": max((g.total_bytes for g in sample.gpus), default=None) if sample else None,
                "step": progress.get("step"), "total_steps": progress.get("total_steps"),
                "samples_per_s": progress.get("samples_per_s"),
                "forecast": sup.trend.forecast.text if sup.trend.forecast else None}

    sup.echo = _whole_lines(lambda raw: line.print_worker_line(raw.decode("utf-8", "replace")))
    logs.show_through(_LineHandler(line))
    sup.listeners.append(lambda name, data: line.update(snapshot()))
    sup.tickers.append(_every(1.0, lambda: line.update(snapshot())))

    def close() -> None:
        line.close()
        logs.reset()

    return close


class _LineHandler(logging.Handler):
    """The supervisor's messages, printed above the status line (which redraws beneath them)."""

    def __init__(self, line: StatusLine) -> None:
        super().__init__()
        self.line = line

    def emit(self, record: logging.LogRecord) -> None:
        self.line.log(self.format(record))


def _whole_lines(show: Callable[[bytes], None], keep: int = 1 << 16) -> Callable[[bytes], None]:
    """The worker's output arrives in chunks; the status line prints whole lines (a partial line is
    held until its newline, or until it grows past ``keep`` bytes)."""
    partial = [b""]

    def echo(chunk: bytes) -> None:
        data = partial[0] + chunk
        cut = data.rfind(b"\n") + 1
        if cut == 0 and len(data) < keep:
            partial[0] = data
            return
        complete, partial[0] = (data[:cut], data[cut:]) if cut else (data, b"")
        for raw in complete.splitlines():
            show(raw)

    return echo


def _every(seconds: float, action: Callable[[], None]) -> Callable[[], None]:
    due = [0.0]

    def tick() -> None:
        if time.monotonic() >= due[0]:
            due[0] = time.monotonic() + seconds
            action()

    return tick


def attach_all(sup: Supervisor) -> list[Callable[[], object]]:
    """Attach every hook; returns what to call at the end."""
    attach_systemd(sup)
    return [c for c in (attach_notifications(sup), attach_statusline(sup)) if c is not None]


# The compact live status line beneath the worker's output, and its journald-friendly twin.
#
# On a terminal, ``rich`` keeps one status line at the bottom (state, attempt, micro × accum =
# global, GPU/host memory, step, samples/s, ETA) and prints the worker's lines above it as they come,
# their colours kept. Anywhere else (a pipe, a file, journald) there is no colour and no redraw: worker
# lines are written unchanged, and the status becomes a plain log line whenever the state, attempt or
# batch changes, and at most once per ``plain_interval_s`` for progress.
#
# The loop feeds it::
#
#     line = StatusLine()
#     line.update({"state": "running", "attempt": 1, "micro_batch": 8, "grad_accum": 4, "world_size": 1})
#     line.print_worker_line(text)        # each line the worker prints
#     line.log("cuda_oom at micro-batch 8; restarting at 4 x 8")
#     line.close()
#
# Snapshot keys, all optional: ``state``, ``attempt``, ``micro_batch``, ``grad_accum``, ``world_size``,
# ``global_batch``, ``asked_global_batch``, ``gpu_bytes``, ``gpu_total_bytes``, ``host_bytes``, ``step``,
# ``total_steps``, ``samples_per_s``, ``eta_s`` (else estimated from the step rate).

_STATE_STYLE = {"running": "bold green", "starting": "bold cyan", "recovering": "bold yellow", "backoff": "bold yellow",
                "succeeded": "bold green", "failed": "bold red", "stopped": "bold magenta"}
# A change in any of these is worth a log line of its own in plain mode.
_KEY_FIELDS = ("state", "attempt", "micro_batch", "grad_accum", "world_size")


def format_duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h07m``, ``2d04h``."""
    total = max(0, int(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def status_parts(snapshot: Mapping[str, Any], eta_s: float | None, times: str = "×") -> list[tuple[str, str]]:
    """The status line as (text, style) parts; pure, shared by both modes."""
    state = str(snapshot.get("state", "starting"))
    parts = [(state, _STATE_STYLE.get(state, "bold"))]
    if snapshot.get("attempt") is not None:
        parts.append((f"attempt {snapshot['attempt']}", ""))
    parts += [(text, style) for text, style in ((_batch_text(snapshot, times), "cyan"), (_memory_text(snapshot), ""))
              if text]
    step, total, rate = snapshot.get("step"), snapshot.get("total_steps"), snapshot.get("samples_per_s")
    if step is not None:
        parts.append((f"step {step}" + (f"/{total}" if total else ""), ""))
    if rate is not None:
        parts.append((f"{float(rate):.1f} samples/s", ""))
    if eta_s is not None:
        parts.append((f"ETA {format_duration(eta_s)}", "bold"))
    if snapshot.get("forecast"):
        parts.append((str(snapshot["forecast"]), "yellow"))
    return parts


def _batch_text(snapshot: Mapping[str, Any], times: str) -> str:
    micro, accum = snapshot.get("micro_batch"), snapshot.get("grad_accum")
    if micro is None or accum is None:
        return ""
    world = int(snapshot.get("world_size") or 1)
    total = snapshot.get("global_batch") or int(micro) * int(accum) * world
    product = f"{micro} {times} {accum}" + (f" {times} {world}" if world > 1 else "")
    asked = snapshot.get("asked_global_batch")
    return f"{product} = {total}" + (f" (asked {asked})" if asked and asked != total else "")


def _memory_text(snapshot: Mapping[str, Any]) -> str:
    texts = []
    gpu, gpu_total = snapshot.get("gpu_bytes"), snapshot.get("gpu_total_bytes")
    if gpu is not None:
        texts.append(f"GPU {gpu / GIB:.1f}" + (f"/{gpu_total / GIB:.1f} GiB" if gpu_total else " GiB"))
    host = snapshot.get("host_bytes")
    if host is not None:
        texts.append(f"host {format_size(host)}")
    return "  ".join(texts)


class EtaEstimator:
    """Seconds left from the step rate seen between updates (an exponential moving average)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, smoothing: float = 0.3) -> None:
        self._clock = clock
        self._smoothing = smoothing
        self._last: tuple[float, int] | None = None
        self._rate: float | None = None  # steps per second

    def observe(self, step: int | None, total: int | None) -> float | None:
        if step is None:
            return None
        now = self._clock()
        last = self._last
        if last is not None and step < last[1]:
            self._rate = None  # resumed from an older checkpoint: the old rate says nothing
        elif last is not None and step > last[1] and now > last[0]:
            rate = (step - last[1]) / (now - last[0])
            self._rate = rate if self._rate is None else self._smoothing * rate + (1 - self._smoothing) * self._rate
        if last is None or step != last[1]:
            self._last = (now, step)
        if not total or not self._rate:
            return None
        return max(0.0, (total - step) / self._rate)


class StatusLine:
    """Live status on a terminal, plain log lines elsewhere; see the module docstring."""

    def __init__(self, stream: TextIO | None = None, *, terminal: bool | None = None, plain_interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream if stream is not None else sys.stdout
        terminal = self._stream.isatty() if terminal is None else terminal
        self._plain_interval_s = plain_interval_s
        self._clock = clock
        self._eta = EtaEstimator(clock)
        self._snapshot: dict[str, Any] = {}
        self._eta_s: float | None = None
        self._last_plain: tuple[tuple[Any, ...], float] | None = None
        self._console = Console(file=self._stream, force_terminal=terminal, no_color=not terminal,
                                highlight=False, emoji=False, markup=False)
        self._live: Live | None = None
        if terminal:
            self._live = Live(self._render(), console=self._console, auto_refresh=False, transient=False)
            self._live.start()

    def update(self, snapshot: Mapping[str, Any]) -> None:
        """Merge ``snapshot`` into the current status and show it (redraw, or a plain line when due)."""
        self._snapshot.update(snapshot)
        eta = snapshot.get("eta_s")
        if "step" in snapshot or "total_steps" in snapshot:
            estimated = self._eta.observe(self._snapshot.get("step"), self._snapshot.get("total_steps"))
            self._eta_s = float(eta) if eta is not None else estimated
        elif eta is not None:
            self._eta_s = float(eta)
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
        else:
            self._maybe_plain_status()

    def print_worker_line(self, line: str) -> None:
        """One line of the worker's output, shown unchanged above the status line."""
        line = line.removesuffix("\n")
        if self._live is None:
            self._stream.write(line + "\n")
            self._stream.flush()
            return
        # from_ansi keeps the worker's colours; soft_wrap leaves wrapping to the terminal.
        self._console.print(Text.from_ansi(line), soft_wrap=True)

    def log(self, message: str) -> None:
        """A message from the supervisor itself, shown like a worker line with an ``oomguard:`` prefix."""
        if self._live is None:
            self.print_worker_line(f"oomguard: {message}")
        else:
            self._console.print(Text(f"oomguard: {message}", style="bold"), soft_wrap=True)

    def close(self) -> None:
        """Stop redrawing; the final status stays on screen (or is logged once more)."""
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
            self._live.stop()
            self._live = None
        elif self._snapshot:
            self._write_plain_status()

    def _render(self) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        for index, (part, style) in enumerate(status_parts(self._snapshot, self._eta_s)):
            if index:
                text.append(" · ", style="dim")
            text.append(part, style=style)
        return text

    def _maybe_plain_status(self) -> None:
        key, last = tuple(self._snapshot.get(name) for name in _KEY_FIELDS), self._last_plain
        if last is None or key != last[0] or self._clock() - last[1] >= self._plain_interval_s:
            self._write_plain_status()

    def _write_plain_status(self) -> None:
        """The current status as one uncoloured line."""
        self._last_plain = (tuple(self._snapshot.get(name) for name in _KEY_FIELDS), self._clock())
        self._stream.write("oomguard: " + " | ".join(text for text, _ in status_parts(self._snapshot, self._eta_s, "x"))
                           + "\n")
        self._stream.flush()
