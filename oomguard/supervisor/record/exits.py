"""How an attempt's process ended, said one way everywhere: status, the report, the dashboard.

``status`` used to print ``exit 1, signal None`` where the report printed ``exit None`` for the
same kind of row. The journal keeps three figures (``returncode`` as Python's ``Popen`` gives it,
and ``exit_code``/``signal`` as the classifier read them); this is the one place that turns them
into words.
"""

from __future__ import annotations

import signal as signals


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
