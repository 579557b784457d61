"""How long a run trained at each world size: an elastic run (torchrun's ``--nnodes MIN:MAX``) that
lost a node went on at a smaller world, at the same global batch, until the node was back.

The time is the attempts' wall time (start to end, or to ``now`` for the one running), summed by the
world size each attempt ran at (the journal's ``world_size`` column); a run that never changed its
world has one entry, which ``worlds_text`` does not repeat.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def by_world(attempts: Sequence[Mapping[str, Any]], now: float | None) -> list[dict[str, Any]]:
    """``[{"world_size", "seconds", "attempts"}]`` in the order the run first trained at each."""
    totals: dict[int, dict[str, Any]] = {}
    for a in attempts:
        end = a.get("ended") if a.get("ended") is not None else now
        if a.get("started") is None or end is None or a.get("world_size") is None:
            continue
        entry = totals.setdefault(int(a["world_size"]), {"world_size": int(a["world_size"]), "seconds": 0.0,
                                                         "attempts": 0})
        entry["seconds"] += max(0.0, float(end) - float(a["started"]))
        entry["attempts"] += 1
    return list(totals.values())


def worlds_text(entries: Sequence[Mapping[str, Any]]) -> str | None:
    """``world 2: 1 min 20 s (2 attempts); world 1: 40.0 s (1 attempt)``; None for a single world."""
    if len(entries) < 2:
        return None
    return "; ".join(f"world {e['world_size']}: {_duration(e['seconds'])} ({e['attempts']} attempt"
                     f"{'' if e['attempts'] == 1 else 's'})" for e in entries)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"
