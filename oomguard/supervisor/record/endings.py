"""The decision recorded when an attempt ends without a failure verdict, as a typed value.

The loop writes these; the reading side never parses them back (it reads the ``ending`` and
``stop_reason`` columns, ``record/picture.py``). ``closing`` gives the three facts together, for
the attempt a restarted supervisor finds left open by its killed predecessor.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oomguard.supervisor.lifecycle.states import Ending, StopReason

INTERRUPTED = Ending.INTERRUPTED.value  # an attempt that ended without a recorded exit (its supervisor died)
# The decision a restarted supervisor writes for an attempt its killed predecessor left open.
CLOSED_INTERRUPTED = f"{INTERRUPTED}: its supervisor ended while it ran"
# The decision of an attempt stopped on request (Ctrl-C, ``oomguard stop``, a service stop): not a failure.
STOPPED = "stopped by"


@dataclass(frozen=True)
class Closing:
    """How an attempt left open is closed: its ending, why it was stopped, and the words recorded."""

    ending: Ending
    stop_reason: StopReason | None
    decision: str


def stopped_by(sig: int) -> str:
    """The decision recorded for an attempt stopped on request, by the signal that asked."""
    return f"{STOPPED} {signal.Signals(sig).name}: a stop asked for, not a failure"


def closing(stop: Mapping[str, Any] | None) -> Closing:
    """The closing of an attempt a later supervisor finds open: the user's stop when one had been
    asked for (its ``stop_requested`` event's data), else interrupted."""
    if stop:
        return Closing(Ending.STOPPED, StopReason.USER, stopped_by(signal.Signals[stop["signal"]]))
    return Closing(Ending.INTERRUPTED, None, CLOSED_INTERRUPTED)


def closing_decision(stop: Mapping[str, Any] | None) -> str:
    """The decision words of ``closing`` alone (what the loop imported from the report)."""
    return closing(stop).decision
