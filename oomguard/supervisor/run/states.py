"""The run's lifecycle. Stdlib only, so every part of oomguard can name a state.

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
