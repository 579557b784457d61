"""The values a run's life is told in, shared by the loop (``run/``) and what records it (``record/``,
``web/``): the run's states, how an attempt ended and why oomguard stopped its worker, and how
``oomguard run`` ends (``UsageError``: exit 2). It imports neither side (only what an ending carries).

Tested in tests/unit/supervisor/test_lifecycle.py, and UsageError by the refusals in test_config.py.

    STARTING ──spawned──> RUNNING ──exit 0──> SUCCEEDED
        ^                    │ failed
        │                    v
        └──restart now── RECOVERING ──give up──> FAILED
        └─── delay ends── BACKOFF <──restart later─┘
    any live state ──stop requested──> STOPPED

A supervisor that starts on an existing run directory begins again at STARTING from whatever the
journal last said, terminal states included: the run continues where it stopped.

An attempt records at most one ``Stop`` (the first reason wins) and returns an ``Outcome``, whose
``ending`` the loop dispatches on as TorchElastic's ``_invoke_run`` does on ``RunResult.state``.
"""

from __future__ import annotations

import enum
import math
import signal
import signal as signals
from dataclasses import dataclass

from oomguard.supervisor.decide.classify import Addition, FailureKind, Verdict
from oomguard.supervisor.observe.checkpoints import Checkpoint
from oomguard.supervisor.observe.progress import AttemptWatch


class RunState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    BACKOFF = "backoff"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


# state -> the states it may come from.
ALLOWED_FROM: dict[RunState, frozenset[RunState]] = {
    RunState.STARTING: frozenset(RunState),
    RunState.RUNNING: frozenset({RunState.STARTING}),
    RunState.RECOVERING: frozenset({RunState.RUNNING, RunState.STARTING}),
    RunState.BACKOFF: frozenset({RunState.RECOVERING}),
    RunState.SUCCEEDED: frozenset({RunState.RUNNING}),
    RunState.FAILED: frozenset({RunState.RECOVERING, RunState.STARTING}),
    RunState.STOPPED: frozenset({RunState.STARTING, RunState.RUNNING, RunState.RECOVERING, RunState.BACKOFF}),
}


class TransitionError(RuntimeError):
    pass


def check_transition(old: RunState, new: RunState) -> None:
    if old not in ALLOWED_FROM[new]:
        raise TransitionError(f"{old.value} -> {new.value} is not a valid transition")


class StopReason(enum.Enum):
    """Why oomguard stopped a worker: given to the one call that stops it, kept as a journal column; each
    reason has its grace (``GRACE_CAP``)."""

    USER = "user"  # SIGINT/SIGTERM to oomguard, or `oomguard stop`
    RESTART = "restart_requested"  # `oomguard restart` or the dashboard's restart button
    PLANNED = "planned_restart"  # the memory forecast: restart right after a checkpoint
    GROW = "grow"  # --grow: restart at a larger micro-batch right after a checkpoint
    MODEL = "model_changed"  # the fit store's size was measured for another model: restart at the size asked for
    MEMORY = "memory_budget"  # a reading broke --memory-limit or the hard threshold
    HANG = "hang"
    PEER = "peer_failed"  # another node's attempt failed; ours would only wait in a collective
    SHUTDOWN = "shutdown"  # the supervisor is leaving with the worker still up


class Ending(enum.Enum):
    """How one attempt ended, dispatched on by the loop. FAILED, HANG and PEER_STOPPED are failures;
    INTERRUPTED is written by a later supervisor for an attempt whose supervisor died."""

    FINISHED = "finished"
    FAILED = "failed"
    HANG = "hang"
    PEER_STOPPED = "peer_stopped"
    STOPPED = "stopped"
    PLANNED_RESTART = "planned_restart"
    GROW = "grow"
    INTERRUPTED = "interrupted"

    @property
    def is_failure(self) -> bool:
        return self in (Ending.FAILED, Ending.HANG, Ending.PEER_STOPPED)


# How ``oomguard run`` ends, as its exit status: what a service manager (the generated systemd unit,
# a Slurm requeue, a shell loop) needs to tell a stop from a give-up from a crash. Stdlib only.
#
# =====  ==========================================================  =============================
#  code   meaning                                                     restart?
# =====  ==========================================================  =============================
#  0      the worker finished                                         no: done
#  1      the policy gave up (a crash loop, does not fit at 1)        no: it would give up again
#  2      a bad option or config value, found at start                no: every start finds it
#  3      an error no restart can fix (ImportError before step 1)     no
#  70     oomguard's own unexpected error (EX_SOFTWARE, cli.py)       yes: a fresh start may pass it
#  75     a peer node was lost (EX_TEMPFAIL, distributed/)            yes: once every node is back
#  130    stopped by SIGINT (Ctrl-C)                                  no: the operator's stop
#  143    stopped by SIGTERM (systemctl stop, oomguard stop)          no: the operator's stop
# =====  ==========================================================  =============================


EXIT_GAVE_UP = 1  # run/loop.py's _dispatch, when the policy's decision is not to restart
EXIT_USAGE = 2
EXIT_UNFIXABLE = 3
EXIT_CRASHED = 70
EXIT_PEER_LOST = 75  # raised as PeerLost in distributed/coordination.py, returned by run/loop.py

NO_RESTART = (EXIT_GAVE_UP, EXIT_USAGE, EXIT_UNFIXABLE)


class UsageError(ValueError):
    """A problem the user fixes by changing how they call oomguard, said in one line; the CLI prints
    it and exits EXIT_USAGE. ``option`` names what is wrong (``--micro-batch``), ``fix`` what to do."""

    def __init__(self, option: str, problem: str, fix: str = "") -> None:
        self.option = option
        self.problem = problem
        self.fix = fix
        text = f"{option}: {problem}" if option else problem
        super().__init__(f"{text}; {fix}" if fix else text)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # run/runparts.py's ControlFlags
STOPPED = tuple(128 + sig for sig in STOP_SIGNALS)  # the loop's _stopped returns 128 + the signal


# How an attempt's process ended, said one way everywhere: status, the report, the dashboard.
#
# ``status`` used to print ``exit 1, signal None`` where the report printed ``exit None`` for the
# same kind of row. The journal keeps three figures (``returncode`` as Python's ``Popen`` gives it,
# and ``exit_code``/``signal`` as the classifier read them); this is the one place that turns them
# into words.


def exit_text(exit_code: int | None, signal: int | None, returncode: int | None = None) -> str:
    """``exit 1``, ``signal 9 (SIGKILL)``, or ``no exit recorded`` (the supervisor ended first)."""
    if signal is not None:
        try:
            return f"signal {signal} ({signals.Signals(signal).name})"
        except ValueError:
            return f"signal {signal}"
    if exit_code is not None:
        return f"exit {exit_code}"
    if returncode is not None:
        return exit_text(None, -returncode) if returncode < 0 else exit_text(returncode, None)
    return "no exit recorded"


# Seconds a stopped worker gets between SIGTERM and SIGKILL, as a cap on --grace-period (inf: the
# whole --grace-period). A restart of any kind lets a preemption-aware script save; a worker over
# its memory budget is pushing the machine towards the kernel's OOM killer, and a hung one or one
# whose peers are gone will not save anything, so those are not waited for long.
GRACE_CAP: dict[StopReason, float] = {
    **dict.fromkeys(StopReason, math.inf), StopReason.MEMORY: 5.0, StopReason.HANG: 10.0, StopReason.PEER: 10.0}


def grace(reason: StopReason, grace_period: float) -> float:
    return min(grace_period, GRACE_CAP[reason])


@dataclass(frozen=True)
class Stop:
    """oomguard stopped the worker: why, and the figures or words that made it."""

    reason: StopReason
    detail: str
    grow_to: int | None = None  # StopReason.GROW and MODEL: the micro-batch to restart at


@dataclass(frozen=True)
class Pending(Stop):
    """A restart planned for right after the next checkpoint: the forecast's (PLANNED) or ``--grow``'s
    (GROW, with the size); at most one per attempt, its ``Stop`` once the checkpoint lands."""

    @property
    def on_save_record(self) -> bool:
        """The forecast's restart is urgent: the worker's word that it saved is enough (a grow waits for the file)."""
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
    """The user's stop wins over everything; a restart oomguard asked for is no failure whatever the
    worker exited with (a script that saves on SIGTERM may exit 0 or 143)."""
    reason = stop.reason if stop is not None else None
    if user_stopped or reason is StopReason.USER:
        return Ending.STOPPED
    if reason in (StopReason.PLANNED, StopReason.RESTART):
        return Ending.PLANNED_RESTART
    if reason in (StopReason.GROW, StopReason.MODEL):
        return Ending.GROW  # a larger micro-batch, no failure; the stop reason says which
    if verdict.kind is None:
        return Ending.FINISHED
    if verdict.kind is FailureKind.HANG:
        return Ending.HANG
    if reason is StopReason.PEER:
        return Ending.PEER_STOPPED
    return Ending.FAILED
