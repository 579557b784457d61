"""One attempt's end as one value: why oomguard stopped its worker (if it did) and how it ended.

The code that watches an attempt records at most one ``Stop`` (the first reason wins: a worker
stopped for a hang that then trips the memory budget was still stopped for the hang) and returns an
``Outcome``; a restart planned for the next checkpoint, whatever planned it, is one ``Pending``
until that checkpoint lands; the loop dispatches on ``Outcome.ending`` the way TorchElastic's ``_invoke_run``
dispatches on ``RunResult.state``. ``ending_of`` is pure, so the tests feed it stops and verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.supervisor.decide.classify import Addition, FailureKind, Verdict
from oomguard.supervisor.lifecycle.states import Ending, StopReason
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.observe.progress import AttemptWatch

# Seconds a stopped worker gets between SIGTERM and SIGKILL, as a cap on --grace-period (None: the
# whole --grace-period). A restart of any kind lets a preemption-aware script save; a worker over
# its memory budget is pushing the machine towards the kernel's OOM killer, and a hung one or one
# whose peers are gone will not save anything, so those are not waited for long.
GRACE_CAP: dict[StopReason, float | None] = {
    StopReason.USER: None,
    StopReason.RESTART: None,
    StopReason.PLANNED: None,
    StopReason.GROW: None,
    StopReason.MODEL: None,
    StopReason.SHUTDOWN: None,
    StopReason.MEMORY: 5.0,
    StopReason.HANG: 10.0,
    StopReason.PEER: 10.0,
}


def grace(reason: StopReason, grace_period: float) -> float:
    cap = GRACE_CAP[reason]
    return grace_period if cap is None else min(grace_period, cap)


@dataclass(frozen=True)
class Stop:
    """oomguard stopped the worker: why, and the figures or words that made it."""

    reason: StopReason
    detail: str
    grow_to: int | None = None  # StopReason.GROW and MODEL: the micro-batch to restart at


@dataclass(frozen=True)
class Pending:
    """A restart planned for right after the next checkpoint, whatever its reason: the memory
    forecast's (``StopReason.PLANNED``) or ``--grow``'s (``StopReason.GROW``, with the size). An
    attempt holds at most one; when the checkpoint lands it becomes the attempt's ``Stop``."""

    reason: StopReason
    detail: str
    grow_to: int | None = None

    @property
    def on_save_record(self) -> bool:
        """The forecast's restart is urgent (the limit comes before the checkpoint after next): the
        worker's own word that it saved is enough. A grow waits for the file to settle, and names it."""
        return self.reason is StopReason.PLANNED

    def stop(self, path: str | None) -> Stop:
        detail = f"{self.detail} after {path}" if self.reason is StopReason.GROW and path else self.detail
        return Stop(self.reason, detail, self.grow_to)


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, with the facts the loop and the policy need afterwards."""

    ending: Ending
    verdict: Verdict
    stop: Stop | None
    watch: AttemptWatch
    checkpoint: Checkpoint | None  # the checkpoint the attempt started from
    returncode: int | None = None  # the worker's, as reaped
    exited_at: float | None = None  # monotonic: when its exit was seen (the moment a failure's trend explains)
    additions: frozenset[Addition] = frozenset()  # oomguard's own code in the worker: the probe, a spare's
    handover_lost: str | None = None  # the spare it was handed to had exited already: why (run/spare.py)


def ending_of(stop: Stop | None, verdict: Verdict, user_stopped: bool) -> Ending:
    """The one value for how an attempt ended. The user's stop wins over everything (a Ctrl-C while a
    planned restart is under way ends the run); a restart oomguard asked for is no failure whatever
    the worker exited with (a script that saves on SIGTERM may exit 0 or 143)."""
    if user_stopped or (stop is not None and stop.reason is StopReason.USER):
        return Ending.STOPPED
    if stop is not None and stop.reason in (StopReason.PLANNED, StopReason.RESTART):
        return Ending.PLANNED_RESTART
    if stop is not None and stop.reason in (StopReason.GROW, StopReason.MODEL):
        return Ending.GROW  # a larger micro-batch, no failure; the stop reason says which
    if verdict.kind is None:
        return Ending.FINISHED
    if verdict.kind is FailureKind.HANG:
        return Ending.HANG
    if stop is not None and stop.reason is StopReason.PEER:
        return Ending.PEER_STOPPED
    return Ending.FAILED
