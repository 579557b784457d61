"""What a matrix case writes at its end (tests/probing_matrix.py reads it): its per-step losses as
``float.hex`` (so two runs compare bitwise), its step times, and dynamo's counters. Imported by the
case scripts from their PYTHONPATH, the same with and without the probe."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def dynamo_counters() -> dict[str, dict[str, int]]:
    """``torch._dynamo.utils.counters`` where the program imported dynamo (never imported here)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    return {kind: {str(key): int(value) for key, value in found.items()} for kind, found in counters.items()}


class Steps:
    """Per-step losses and times (``start()`` then ``done(loss)`` around each step). The times are the
    main thread's CPU time: the probe's work is done in that thread, and on a loaded box CPU time is
    far steadier than wall time (other processes' share of the cores is not counted)."""

    def __init__(self) -> None:
        self.losses: list[str] = []
        self.times: list[float] = []
        self._started = 0.0

    def start(self) -> None:
        self._started = time.thread_time()

    def done(self, loss: Any) -> None:
        """One step ended with ``loss`` (a tensor or a float), read after the step's work."""
        value = float(loss.detach().float().item() if hasattr(loss, "detach") else loss)
        self.times.append(time.thread_time() - self._started)
        self.losses.append(value.hex())

    def write(self, **extra: Any) -> None:
        path = os.environ.get("MATRIX_OUT")
        if not path:
            return
        data = {"losses": self.losses, "times": self.times, "counters": dynamo_counters(), **extra}
        with open(path, "w") as out:
            json.dump(data, out)
