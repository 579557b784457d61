"""Reporting checkpoint saves: ``torch.save`` wrapped once, a ``save`` record after each save returns.

Tested in tests/e2e/test_probe.py and tests/e2e/test_step_truth.py.

A checkpoint whose name carries no step (nanoGPT rewrites ``out/ckpt.pt``) took its step from the
last step record before the file's mtime; step records are written at most every half second, so
that was a lower bound, steps short of what the file holds. The save itself knows: the record says
the optimizer step counted when the save began (none before the process's first step: nanoGPT
re-saves right after resuming, before its resumed count is read), and when it began and returned. The file's mtime
lies between the two whatever it is renamed to afterwards (``ckpt.pt.tmp`` then ``os.replace``).

The wrapper adds two clock reads and one record per save (saves are rare and take far longer);
the save's own exception goes to the program unchanged, a failure of ours is a ``probe`` record.
A program that took ``torch.save`` before torch finished importing keeps the unwrapped one.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from ..common import protocol
from . import channel

_MARK = "_oomguard_save"


def _path(f: Any) -> str | None:
    """The file a save wrote, when it was named (a path); None for a file object or a buffer."""
    if isinstance(f, (str, os.PathLike)):
        return os.path.abspath(os.fsdecode(f))
    return None


def install(torch: Any, step: Callable[[], int | None], after: Callable[[], None] = lambda: None) -> None:
    """Wrap ``torch.save`` (once) to report each save with ``step()`` at its start (None before the
    process's first optimizer step, when a resumed count is not known yet); ``after()`` then runs
    (the memory breakdown's peak, probe/memsplit.py: a checkpoint is a cheap moment to say it)."""
    original = torch.save
    if getattr(original, _MARK, False):
        return
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)

    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if compiling():  # traced by dynamo (a save inside compiled code): the save alone, as without us
            return original(obj, f, *args, **kwargs)
        started, at = time.time(), step()
        result = original(obj, f, *args, **kwargs)  # its exception is the program's
        try:
            channel.emit(protocol.SAVE, path=_path(f), step=at, started=started)
            after()
        except Exception as exc:  # a bug of ours must not fail a save that succeeded
            channel.failed(f"save report: {type(exc).__name__}: {exc}")
        return result

    setattr(save, _MARK, True)
    torch.save = save
