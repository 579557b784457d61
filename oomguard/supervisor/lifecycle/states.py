"""The run's lifecycle. Stdlib only, so every part of oomguard can name a state.

Tested in tests/unit/supervisor/lifecycle/test_outcome.py.

    STARTING ──spawned──> RUNNING ──exit 0──> SUCCEEDED
        ^                    │ failed
        │                    v
        └──restart now── RECOVERING ──give up──> FAILED
        └─── delay ends── BACKOFF <──restart later─┘
    any live state ──stop requested──> STOPPED

A supervisor that starts on an existing run directory begins again at STARTING from whatever the
journal last said, terminal states included: the run continues where it stopped.

Also here:

- How ``oomguard run`` ends, as its exit status: what a service manager (the generated systemd unit,
- How an attempt's process ended, said one way everywhere: status, the report, the dashboard.
"""

from __future__ import annotations

import enum
import signal
import signal as signals


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
    """Why oomguard stopped a worker: given to the one call that stops it, kept as a journal column.

    Each reason has its own grace period (``lifecycle.outcome.GRACE``): a worker stopped for a restart is
    asked to save first, one that broke the memory budget or hung is not waited for long.
    """

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
    """How one attempt ended: the value the attempt returns and the loop dispatches on.

    FINISHED and the failures go to the policy (FAILED, HANG and PEER_STOPPED carry a verdict);
    STOPPED is the user's and never a failure; PLANNED_RESTART and GROW restart at once with no
    failure; INTERRUPTED is written by a later supervisor for an attempt whose supervisor died.
    """

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


EXIT_FINISHED = 0
EXIT_GAVE_UP = 1  # run/loop.py's _dispatch, when the policy's decision is not to restart
EXIT_USAGE = 2
EXIT_UNFIXABLE = 3
EXIT_CRASHED = 70
EXIT_PEER_LOST = 75  # raised as PeerLost in distributed/coordination.py, returned by run/loop.py

NO_RESTART = (EXIT_GAVE_UP, EXIT_USAGE, EXIT_UNFIXABLE)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # run/control.py's stop handlers
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
