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
"""

from __future__ import annotations

import enum


class RunState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    BACKOFF = "backoff"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.STOPPED)


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
