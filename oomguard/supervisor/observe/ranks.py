"""Which rank a process is: torchrun gives every rank ``RANK`` (and ``LOCAL_RANK``) in its environment."""

from __future__ import annotations

from pathlib import Path


def process_rank(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The global rank of process ``pid`` (its RANK), or None for a process that is no rank or
    whose environment we may not read (read each time: pids are reused)."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    for entry in raw.split(b"\0"):
        if entry.startswith(b"RANK="):
            value = entry[5:].decode(errors="replace")
            return int(value) if value.isdigit() else None
    return None
