"""How the probe speaks: ``common.protocol`` records, each with the process's identity, never raising.

Tested in tests/e2e/test_probe.py (the records real probed processes write).

Every probe record carries pid, rank, local_rank and world_size, read when it is written (a
launcher may set them after the process started). A channel that cannot be written loses the
record: the probe is evidence, and the program's run matters more.
"""

from __future__ import annotations

import os
from typing import Any

from ..common import protocol


def env_int(name: str) -> int | None:
    """An integer in the environment (a rank, the micro-batch the supervisor set), or None."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def identity() -> dict[str, int | None]:
    return {"pid": os.getpid(), "rank": env_int("RANK"), "local_rank": env_int("LOCAL_RANK"),
            "world_size": env_int("WORLD_SIZE")}


def emit(record_type: str, **fields: Any) -> None:
    try:
        protocol.emit(record_type, **fields, **identity())
    except (OSError, ValueError, TypeError):
        pass  # a full disk or a value json cannot write: this record is lost, the program goes on


def failed(detail: str) -> None:
    """One ``probe`` record saying what did not work (the run goes on without that part)."""
    emit(protocol.PROBE, state="failed", detail=detail[:500])


def loaded(detail: str) -> None:
    emit(protocol.PROBE, state="loaded", detail=detail)


def partial(detail: str) -> None:
    """One ``probe`` record saying what the probe does not do in this process, by design (the rest runs)."""
    emit(protocol.PROBE, state="partial", detail=detail[:500])
