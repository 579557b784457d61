"""The supervisor's own messages: one path, the stdlib logger ``oomguard``.

Tested in tests/e2e/test_supervisor.py (what a real run prints).

Every part says what it has to say through ``say`` (or ``logging.getLogger(__name__)`` under
``oomguard.``); where it lands is the handler's business: stderr with an ``[oomguard]`` prefix by
default, the terminal status line when one is shown (``ops.statusline``), whatever a host program
configures otherwise. The worker's own output never goes through here: it is bytes, echoed as they
come.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("oomguard")


class _Stderr(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (pytest and the CLI swap it), flushed per line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"[oomguard] {self.format(record)}", file=sys.stderr, flush=True)
        except Exception:  # a closed stderr must not stop supervision
            self.handleError(record)


def _ensure_handler() -> None:
    if not LOGGER.handlers:
        LOGGER.addHandler(_Stderr())
        LOGGER.setLevel(logging.INFO)
        LOGGER.propagate = False  # one copy of each line, whatever the root logger does


def say(message: str) -> None:
    _ensure_handler()
    LOGGER.info(message)


def show_through(handler: logging.Handler) -> None:
    """Send every message to ``handler`` instead of stderr (the status line redraws around them)."""
    _ensure_handler()
    for old in list(LOGGER.handlers):
        LOGGER.removeHandler(old)
    LOGGER.addHandler(handler)


def reset() -> None:
    """Back to stderr (after the status line closes)."""
    for old in list(LOGGER.handlers):
        LOGGER.removeHandler(old)
    _ensure_handler()
