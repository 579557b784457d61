"""``oomguard checkpoint``: ask for a checkpoint and say whether one was written.

It used to print ``checkpoint requested`` and exit 0 whatever happened, also when the worker had no
handler for the signal and nothing was ever written. Now it follows the journal after the request:
the loop's ``checkpoint_request`` event says whether the signal was sent (only to a worker that
handles it; the request file is written either way, for scripts that poll it), and a ``checkpoint``
event, or the worker removing the request file (the protocol's acknowledgement), says one was
written. Nothing within ``--wait`` seconds: one line saying so, exit 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.supervisor.record.journal import Journal, open_existing

DEFAULT_WAIT = 300.0  # a large model's state takes minutes to write; --wait 0 only asks
POLL = 0.2
REQUEST_FILE = "checkpoint.request"  # run/runtime.py's AttemptFiles.checkpoint_request
_OVER = frozenset({"stopped", "failed", "succeeded"})


def ask_and_wait(run_dir: Path, wait: float, send: Callable[[], str], say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> int:
    """Send the request (``send``), then follow the journal for up to ``wait`` seconds; 0 when a
    checkpoint was written, 1 when none was."""
    journal = open_existing(run_dir)
    try:
        since, meta = journal.last_event_id(), journal.meta()
        say(send())
        if wait <= 0:
            return 0
        return _follow(journal, run_dir, since, meta, wait, say, clock)
    finally:
        journal.close()


def _follow(journal: Journal, run_dir: Path, since: int, meta: dict[str, Any], wait: float,
            say: Callable[[str], None], clock: Callable[[], float]) -> int:
    started, handled = clock(), None
    signal_name = (meta.get("config") or {}).get("checkpoint_signal", "SIGUSR1")
    while clock() - started < wait:
        for event in journal.events(since):
            since, kind, data = event["id"], event["kind"], event["data"]
            if kind == "checkpoint_request" and data.get("reason") == "requested" and handled is None:
                handled = data.get("signal") is not None
                if not handled:
                    say(f"the worker has no handler for {signal_name}: only the request file was written "
                        f"({run_dir / REQUEST_FILE}), which a script must poll (the worker library does both)")
            elif kind == "checkpoint":
                step = f" (step {data['step']})" if data.get("step") is not None else ""
                say(f"checkpoint written: {data['path']}{step}, {clock() - started:.0f} s after the request")
                return 0
            elif kind == "state" and data.get("to") in _OVER:
                say(f"no checkpoint: the run ended ({data['to']}: {data.get('reason', '')})")
                return 1
        if handled is not None and not (run_dir / REQUEST_FILE).exists():
            say("the worker acknowledged the request (it removed the request file)"
                + ("" if (meta.get("config") or {}).get("checkpoints") else
                   "; no --checkpoint glob is watched, so oomguard cannot name the file"))
            return 0
        time.sleep(POLL)
    why = "" if handled is not False else f" (the worker does not handle {signal_name})"
    say(f"no checkpoint appeared within {wait:g} s{why}; see oomguard logs --run-dir {run_dir}")
    return 1
