"""The compact live status line beneath the worker's output, and its journald-friendly twin.

On a terminal, ``rich`` keeps one status line at the bottom (state, attempt, micro × accum =
global, GPU/host memory, step, samples/s, ETA) and prints the worker's lines above it as they come,
their colours kept. Anywhere else (a pipe, a file, journald) there is no colour and no redraw: worker
lines are written unchanged, and the status becomes a plain log line whenever the state, attempt or
batch changes, and at most once per ``plain_interval_s`` for progress.

The loop feeds it::

    line = StatusLine()
    line.update({"state": "running", "attempt": 1, "micro_batch": 8, "grad_accum": 4, "world_size": 1})
    line.print_worker_line(text)        # each line the worker prints
    line.log("cuda_oom at micro-batch 8; restarting at 4 x 8")
    line.close()

Snapshot keys, all optional: ``state``, ``attempt``, ``micro_batch``, ``grad_accum``,
``world_size``, ``global_batch``, ``asked_global_batch``, ``gpu_bytes``, ``gpu_total_bytes``, ``host_bytes``, ``step``,
``total_steps``, ``samples_per_s``, ``eta_s`` (else estimated from the step rate).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.text import Text

from oomguard.supervisor.units import GIB, format_size

_STATE_STYLE = {
    "running": "bold green",
    "starting": "bold cyan",
    "recovering": "bold yellow",
    "backoff": "bold yellow",
    "succeeded": "bold green",
    "failed": "bold red",
    "stopped": "bold magenta",
}
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
    parts: list[tuple[str, str]] = []
    state = str(snapshot.get("state", "starting"))
    parts.append((state, _STATE_STYLE.get(state, "bold")))
    if snapshot.get("attempt") is not None:
        parts.append((f"attempt {snapshot['attempt']}", ""))
    batch = _batch_text(snapshot, times)
    if batch:
        parts.append((batch, "cyan"))
    memory = _memory_text(snapshot)
    if memory:
        parts.append((memory, ""))
    parts += _progress_parts(snapshot, eta_s)
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


def _progress_parts(snapshot: Mapping[str, Any], eta_s: float | None) -> list[tuple[str, str]]:
    parts: list[tuple[str, str]] = []
    step, total = snapshot.get("step"), snapshot.get("total_steps")
    if step is not None:
        parts.append((f"step {step}" + (f"/{total}" if total else ""), ""))
    rate = snapshot.get("samples_per_s")
    if rate is not None:
        parts.append((f"{float(rate):.1f} samples/s", ""))
    if eta_s is not None:
        parts.append((f"ETA {format_duration(eta_s)}", "bold"))
    return parts


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
            self._rate = (
                rate if self._rate is None else self._smoothing * rate + (1 - self._smoothing) * self._rate
            )
        if last is None or step != last[1]:
            self._last = (now, step)
        if not total or not self._rate:
            return None
        return max(0.0, (total - step) / self._rate)


class StatusLine:
    """Live status on a terminal, plain log lines elsewhere; see the module docstring."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        terminal: bool | None = None,
        plain_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self.is_terminal = self._stream.isatty() if terminal is None else terminal
        self._plain_interval_s = plain_interval_s
        self._clock = clock
        self._eta = EtaEstimator(clock)
        self._snapshot: dict[str, Any] = {}
        self._eta_s: float | None = None
        self._last_plain: tuple[tuple[Any, ...], float] | None = None
        self._console = Console(
            file=self._stream,
            force_terminal=self.is_terminal,
            no_color=not self.is_terminal,
            highlight=False,
            emoji=False,
            markup=False,
        )
        self._live: Live | None = None
        if self.is_terminal:
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
        line = line[:-1] if line.endswith("\n") else line
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

    def plain_status(self) -> str:
        """The current status as one uncoloured line."""
        return "oomguard: " + " | ".join(text for text, _ in status_parts(self._snapshot, self._eta_s, "x"))

    def _render(self) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        for index, (part, style) in enumerate(status_parts(self._snapshot, self._eta_s)):
            if index:
                text.append(" · ", style="dim")
            text.append(part, style=style)
        return text

    def _maybe_plain_status(self) -> None:
        key = tuple(self._snapshot.get(name) for name in _KEY_FIELDS)
        now = self._clock()
        if self._last_plain is not None:
            last_key, last_time = self._last_plain
            if key == last_key and now - last_time < self._plain_interval_s:
                return
        self._write_plain_status()

    def _write_plain_status(self) -> None:
        key = tuple(self._snapshot.get(name) for name in _KEY_FIELDS)
        self._last_plain = (key, self._clock())
        self._stream.write(self.plain_status() + "\n")
        self._stream.flush()
