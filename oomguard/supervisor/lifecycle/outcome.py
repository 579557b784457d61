"""One attempt's end as one value: why oomguard stopped its worker (if it did) and how it ended.

The code that watches an attempt records at most one ``Stop`` (the first reason wins: a worker
stopped for a hang that then trips the memory budget was still stopped for the hang) and returns an
``Outcome``; the loop dispatches on ``Outcome.ending`` the way TorchElastic's ``_invoke_run``
dispatches on ``RunResult.state``. ``ending_of`` is pure, so the tests feed it stops and verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.supervisor.decide.classify import FailureKind, Verdict
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
class Outcome:
    """How an attempt ended, with the facts the loop and the policy need afterwards."""

    ending: Ending
    verdict: Verdict
    stop: Stop | None
    watch: AttemptWatch
    checkpoint: Checkpoint | None  # the checkpoint the attempt started from


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
