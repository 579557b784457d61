"""What the supervisor tells the world as the run goes: systemd, notifications, the terminal status line.

Each hook subscribes to ``Supervisor.listeners`` (events) and ``Supervisor.tickers`` (every loop
tick); none of them can block or stop supervision (the loop catches their errors, notifications
are sent from their own threads, sd_notify is one datagram).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from oomguard.supervisor.ops import notify
from oomguard.supervisor.ops.notify import (
    COMPONENT,
    degraded,
    gave_up,
    leak,
    notify_config,
    recovered,
    succeeded,
    warning,
)
from oomguard.supervisor.ops.sdnotify import SystemdNotifier, Watchdog
from oomguard.supervisor.ops.statusline import StatusLine
from oomguard.supervisor.record import console
from oomguard.supervisor.run.wiringwatch import WARNING_EVENTS

if TYPE_CHECKING:
    from oomguard.supervisor.run.loop import Supervisor

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
    if not sup.config.notify:
        return None
    sender = notify.Notifier(notify_config(sup.config.notify), health=sup.degradations)
    run = sup.run_dir.name
    told_leak = [False]  # a leak is told once: every restart it causes would say the same
    cause: dict[str, Any] = {}  # the newest attribution: its summary and the figures that decided it
    last_cause: list[dict[str, Any]] = []  # the cause of the failure the run gave up after
    told: set[str] = set()  # so is each kind of wiring warning (a resume missed at every restart)
    filled = notify.FailureMemory()  # what filled memory at the failure, told with its decision

    def on_event(name: str, data: dict[str, Any]) -> None:
        if name == "attribution":
            cause.clear()
            cause.update(data)
            return
        if filled.heard(name, data):
            return
        memory = filled.take() if name == "decision" else None
        figures = {"cause": dict(cause)} if cause and name == "decision" else {}
        if name == "decision":
            cause.clear()  # told with this decision; a later failure has its own
        is_leak = data.get("cause") == "leak" or name == "planned_restart"
        if is_leak and name in ("decision", "planned_restart") and data.get("action", "restart") == "restart":
            if not told_leak[0]:
                told_leak[0] = True
                sender.send(leak(run, data["reason"], attempt=sup.attempt, **figures))
        elif name == "decision" and data["kind"] in MEMORY_KINDS and data["action"] == "restart":
            sender.send(recovered(run, data["kind"], sup.plan.batch.micro_batch, data["micro_batch"],
                                  data["grad_accum"], figures["cause"].get("summary") if figures else None, memory,
                                  evidence=data["evidence"], attempt=sup.attempt, **figures))
        elif name == "decision" and data["action"] == "give_up" and figures:
            last_cause[:] = [figures["cause"]]
        elif name in WARNING_EVENTS and name not in told:
            told.add(name)
            sender.send(warning(run, data["message"], attempt=sup.attempt))
        elif name == "state" and data["to"] == "failed":
            reason, given = data["reason"], last_cause[0] if last_cause else None
            if given and given["summary"] not in reason:
                reason += f"\ncause: {given['summary']}"
            sender.send(gave_up(run, reason, attempt=sup.attempt, **({"cause": given} if given else {})))
        elif name == "state" and data["to"] == "succeeded":
            sender.send(succeeded(run, summary(sup), attempt=sup.attempt))

    sup.listeners.append(on_event)
    sup.tickers.append(_on_degradation(sup, lambda c, m: sender.send(degraded(run, c, m, attempt=sup.attempt))))
    return lambda: sender.close(10.0)


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
            if component not in told and not component.startswith(COMPONENT + " "):
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
    console.show_through(_LineHandler(line))
    sup.listeners.append(lambda name, data: line.update(snapshot()))
    sup.tickers.append(_every(1.0, lambda: line.update(snapshot())))

    def close() -> None:
        line.close()
        console.reset()

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
    import time

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
