"""Acting before the crash: a pure function from one memory sample to what the loop should do.

``evaluate(sample, thresholds, checkpoint_pending)`` returns a ``MemoryVerdict``:

- ``STOP`` (hard): the worker's process tree is over ``--memory-limit``. The loop stops it cleanly
  (SIGTERM, grace, SIGKILL) and records a ``memory_limit`` failure, so the kernel's OOM killer never
  has to pick a victim (it may pick the user's shell, tmux or the supervisor).
- ``CHECKPOINT`` (soft): some budget is at or above ``--soft-threshold`` (GPU memory, the
  ``--memory-limit``, the cgroup limit, the host's RAM) or PSI is above ``--psi-threshold``. The
  loop asks the worker to checkpoint now; a request already pending is not repeated.
- ``NONE``.

No I/O, no clock: the tests feed it samples.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from oomguard.supervisor.observe.memory import MemorySample
from oomguard.supervisor.units import format_size


class MemoryAction(enum.Enum):
    """What the loop should do about memory now."""

    NONE = "none"
    CHECKPOINT = "checkpoint"  # ask the worker to save now (signal + request file)
    STOP = "stop"  # stop the worker as a memory_limit failure


@dataclass(frozen=True)
class Thresholds:
    """The memory thresholds; validated here so the CLI and the TOML file share the messages.

    ``soft_fraction``: ``--soft-threshold``, a fraction of each budget (0.95 = 95 %).
    ``psi_some_avg10``: ``--psi-threshold``, percent of the last 10 s in which some task stalled
        on memory; None turns the PSI trigger off.
    ``memory_limit_bytes``: ``--memory-limit``, the hard cap on the worker tree's RSS; None = none.
    """

    soft_fraction: float = 0.95
    psi_some_avg10: float | None = None
    memory_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        soft, psi, limit = self.soft_fraction, self.psi_some_avg10, self.memory_limit_bytes
        if not 0.0 < soft <= 1.0:
            hint = f"; for {soft:g}% write {soft / 100:g} or {soft:g}%" if 1 < soft <= 100 else ""
            raise ValueError(f"--soft-threshold must be a fraction in (0, 1], e.g. 0.95, got {soft:g}{hint}")
        if psi is not None and not 0.0 < psi <= 100.0:
            raise ValueError(
                f"--psi-threshold is the percent of time stalled on memory, in (0, 100], e.g. 20; got {psi:g}"
                " (leave it out to disable the PSI trigger)"
            )
        if limit is not None and limit <= 0:
            raise ValueError(
                f"--memory-limit must be a positive size such as 16G or 800M, got {limit} bytes"
                " (leave it out for no limit)"
            )


def parse_fraction(text: str) -> float:
    """``--soft-threshold``'s text: ``0.95`` or ``95%``; raises ValueError naming the option."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(
            f"--soft-threshold must be a fraction like 0.95 or a percentage like 95%, got {text!r}"
        ) from None
    return value


@dataclass(frozen=True)
class MemoryVerdict:
    """The decision and its evidence (the figure that decided, for the journal and status)."""

    action: MemoryAction
    reason: str = ""
    evidence: str = ""


def evaluate(sample: MemorySample, thresholds: Thresholds, checkpoint_pending: bool) -> MemoryVerdict:
    """What to do about ``sample``: stop beats checkpoint beats nothing."""
    hard = _hard_limit(sample, thresholds)
    if hard is not None:
        return hard
    soft = _soft_trigger(sample, thresholds)
    if soft is None:
        return MemoryVerdict(MemoryAction.NONE)
    if checkpoint_pending:
        # The worker is (or should be) saving already; a second signal would only interrupt it.
        return MemoryVerdict(MemoryAction.NONE, "checkpoint request already pending", soft.evidence)
    return soft


def _hard_limit(sample: MemorySample, thresholds: Thresholds) -> MemoryVerdict | None:
    limit, rss = thresholds.memory_limit_bytes, sample.worker_rss_bytes
    if limit is None or rss is None or rss < limit:
        return None
    return MemoryVerdict(
        MemoryAction.STOP,
        "memory_limit",
        f"worker tree RSS {format_size(rss)} >= --memory-limit {format_size(limit)} (pids {_pids(sample)})",
    )


def _soft_trigger(sample: MemorySample, thresholds: Thresholds) -> MemoryVerdict | None:
    """The first budget at or over the soft fraction, or PSI over its level."""
    for label, used, budget in _budgets(sample, thresholds):
        if budget > 0 and used >= thresholds.soft_fraction * budget:
            return MemoryVerdict(
                MemoryAction.CHECKPOINT,
                "soft_threshold",
                f"{label} {format_size(used)} of {format_size(budget)} = {used / budget:.1%}"
                f" >= --soft-threshold {thresholds.soft_fraction:.0%}",
            )
    psi = sample.pressure
    level = thresholds.psi_some_avg10
    if level is not None and psi is not None and psi.some_avg10 >= level:
        return MemoryVerdict(
            MemoryAction.CHECKPOINT,
            "memory_pressure",
            f"PSI memory some avg10 {psi.some_avg10:.1f}% >= --psi-threshold {level:g}%",
        )
    return None


def _budgets(sample: MemorySample, thresholds: Thresholds) -> list[tuple[str, int, int]]:
    """(label, used, budget) for every budget the sample lets us judge."""
    budgets = [
        # The whole device counts, not only the worker's share: another process filling the
        # GPU makes the worker's next allocation fail just the same.
        (f"GPU {g.cuda_index} ({g.name}) used", g.used_bytes, g.total_bytes)
        for g in sample.gpus
    ]
    if thresholds.memory_limit_bytes is not None and sample.worker_rss_bytes is not None:
        budgets.append(("worker tree RSS", sample.worker_rss_bytes, thresholds.memory_limit_bytes))
    cg = sample.cgroup
    if cg is not None and cg.limit_bytes is not None:
        budgets.append((f"cgroup {cg.path} working set", cg.working_set_bytes, cg.limit_bytes))
    in_use = sample.host_total_bytes - sample.host_available_bytes
    budgets.append(("host memory in use", in_use, sample.host_total_bytes))
    return budgets


def _pids(sample: MemorySample) -> str:
    shown = ",".join(str(p) for p in sample.worker_pids[:8])
    return shown + (",..." if len(sample.worker_pids) > 8 else "")
