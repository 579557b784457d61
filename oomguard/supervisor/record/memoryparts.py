"""What filled memory, as the journal's ``memory_breakdown`` events say it: one typed value per event.

The probe (or, at a host or kernel OOM, the last reading before it) splits a rank's memory into the
parts a user knows: weights, gradients, optimizer state, activations and temporaries (the rest of
what the allocator or the process holds) and the allocator's cache (reserved but unallocated). The
event's format is fixed in docs/outputs.md; this module parses it once (``parse``) into
``MemoryBreakdown``, which status, ``/metrics``, the notification and the dashboard render. A part the
event gives as null was not seen: it stays ``None`` here and is said "not seen", never guessed.

``weights`` counts every parameter; ``frozen_weights`` is the share of them that trains not (no
gradient, no optimizer state: a LoRA fine-tune's base model), so it is said inside the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.units import format_size

EVENT = "memory_breakdown"
# The parts of a bar, bottom to top: what the model is, then what training adds, then what the
# allocator keeps for later. (key in the event, the words a user reads)
PARTS = (("weights", "weights"), ("gradients", "gradients"), ("optimizer_state", "optimizer state"),
         ("activations", "activations"), ("cache", "cache"))
AT_WORDS = {"oom": "at the OOM", "peak": "at its peak (it fit)", "last_reading": "last reading before the failure"}
ROLES = ("trainer", "data-loader worker", "other")


@dataclass(frozen=True)
class Part:
    key: str
    label: str
    bytes: int | None  # None: not seen


@dataclass(frozen=True)
class Process:
    pid: int
    role: str
    name: str
    rss: int


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's memory at one moment of one attempt."""

    attempt: int
    micro_batch: int | None
    rank: int | None
    at: str  # "oom", "peak" (an attempt that fit) or "last_reading" (host/kernel OOM)
    device: str
    parts: tuple[Part, ...]
    frozen_weights: int
    optimizers: tuple[str, ...]
    total: int | None
    limit: int | None
    limit_kind: str | None
    processes: tuple[Process, ...] | None

    @property
    def failed(self) -> bool:
        return self.at != "peak"

    def as_dict(self) -> dict[str, Any]:
        """The JSON form status, the API and the dashboard read (every part listed, null when not seen)."""
        return {"attempt": self.attempt, "micro_batch": self.micro_batch, "rank": self.rank, "at": self.at,
                "device": self.device, "parts": [{"key": p.key, "label": p.label, "bytes": p.bytes}
                                                 for p in self.parts],
                "frozen_weights": self.frozen_weights, "optimizers": list(self.optimizers),
                "total": self.total, "limit": self.limit, "limit_kind": self.limit_kind,
                "processes": None if self.processes is None else [
                    {"pid": p.pid, "role": p.role, "name": p.name, "rss": p.rss} for p in self.processes],
                "text": parts_text(self), "line": line(self)}


def _size(value: Any) -> int | None:
    """A byte count, or None for null and for anything that is not one (never a guess)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse(data: Mapping[str, Any], attempt: int | None = None) -> MemoryBreakdown | None:
    """The event's data as a value; None when it is not a breakdown (no attempt, an unknown moment)."""
    number = _size(data.get("attempt")) if data.get("attempt") is not None else _size(attempt)
    if number is None or data.get("at") not in AT_WORDS:
        return None
    procs = data.get("processes")
    return MemoryBreakdown(
        attempt=number, micro_batch=_size(data.get("micro_batch")), rank=_size(data.get("rank")),
        at=str(data["at"]), device=str(data.get("device") or "?"),
        parts=tuple(Part(key, label, _size(data.get(key))) for key, label in PARTS),
        frozen_weights=_size(data.get("frozen_weights")) or 0,
        optimizers=tuple(str(o) for o in data.get("optimizers") or () if isinstance(o, str)),
        total=_size(data.get("total")), limit=_size(data.get("limit")),
        limit_kind=str(data["limit_kind"]) if data.get("limit_kind") else None,
        processes=None if not isinstance(procs, list) else tuple(_processes(procs)))


def _processes(rows: Sequence[Any]) -> list[Process]:
    return [Process(int(r["pid"]), str(r.get("role") or "other"), str(r.get("name") or "?"), rss)
            for r in rows if isinstance(r, Mapping) and _size(r.get("pid")) is not None
            and (rss := _size(r.get("rss"))) is not None]


def from_events(events: Sequence[Mapping[str, Any]]) -> list[MemoryBreakdown]:
    """The breakdowns among journal events (rows with ``data`` and ``attempt``), oldest first."""
    found = (parse(e.get("data") or {}, e.get("attempt")) for e in events)
    return [b for b in found if b is not None]


# --- words ------------------------------------------------------------------------------------


def part_text(part: Part, value: MemoryBreakdown) -> str:
    """``optimizer state 2.4 GiB (AdamW)``, ``weights 1.2 GiB (0.9 GiB of them frozen)``, ``cache not seen``."""
    if part.bytes is None:
        return f"{part.label} not seen"
    text = f"{part.label} {format_size(part.bytes)}"
    if part.key == "weights" and value.frozen_weights:
        text += f" ({format_size(value.frozen_weights)} of them frozen)"
    if part.key == "optimizer_state" and value.optimizers:
        text += f" ({', '.join(value.optimizers)})"
    return text


def limit_text(value: MemoryBreakdown) -> str:
    """``limit 20.0 GiB (gpu)``, or that no limit was seen."""
    if value.limit is None:
        return "limit not seen"
    return f"limit {format_size(value.limit)}" + (f" ({value.limit_kind})" if value.limit_kind else "")


def by_role(processes: Sequence[Process]) -> dict[str, int]:
    """The reading summed per kind of process (trainer, data-loader worker, other)."""
    found: dict[str, int] = {}
    for p in processes:
        found[p.role] = found.get(p.role, 0) + p.rss
    return found


def processes_text(processes: Sequence[Process]) -> str:
    """``trainer 1.1 GiB, 2 data-loader workers 0.6 GiB``: the reading per role, largest role first."""
    by_role: dict[str, list[int]] = {}
    for p in processes:
        by_role.setdefault(p.role, []).append(p.rss)
    ordered = sorted(by_role.items(), key=lambda kv: -sum(kv[1]))
    return ", ".join(f"{len(rss)} {role}s {format_size(sum(rss))}" if len(rss) > 1
                     else f"{role} {format_size(rss[0])}" for role, rss in ordered)


def parts_text(value: MemoryBreakdown) -> str:
    """``weights 1.2 GiB, gradients 1.2 GiB, optimizer state 2.4 GiB (AdamW), activations 13.8 GiB,
    cache not seen; limit 20.0 GiB (gpu)``; with the per-process reading where there is one."""
    seen = [p for p in value.parts if p.bytes is not None]
    text = ", ".join(part_text(p, value) for p in value.parts) if seen else "no part seen"
    if value.processes:
        text += f"; by process: {processes_text(value.processes)}"
    return f"{text}; {limit_text(value)}"


def headline(value: MemoryBreakdown) -> str:
    """``attempt 3 at micro-batch 32, rank 0, at the OOM``: whose memory, and when it was read."""
    where = f"attempt {value.attempt}" + (f" at micro-batch {value.micro_batch}" if value.micro_batch else "")
    if value.rank is not None:
        where += f", rank {value.rank}"
    return f"{where}, {AT_WORDS[value.at]}"


def line(value: MemoryBreakdown) -> str:
    """One line for the notification and status: whose memory, when, and its parts."""
    return f"{headline(value)}: {parts_text(value)}"


# --- which to show ----------------------------------------------------------------------------


def fullest(values: Sequence[MemoryBreakdown]) -> MemoryBreakdown:
    """Of several ranks' breakdowns, the one nearest its limit (the rank that ran out), else the largest."""
    def key(b: MemoryBreakdown) -> tuple[float, int]:
        held = b.total if b.total is not None else sum(p.bytes or 0 for p in b.parts)
        return (held / b.limit if b.limit else 0.0, held)
    return max(values, key=key)


def per_attempt(values: Sequence[MemoryBreakdown]) -> list[MemoryBreakdown]:
    """One breakdown per attempt and moment (a failure, or the peak of an attempt that fit), the
    fullest rank's, in attempt order: the bars of the dashboard."""
    newest: dict[tuple[int, str, int | None], MemoryBreakdown] = {}
    for b in values:  # a later event for the same rank and moment is the newer reading
        newest[(b.attempt, b.at, b.rank)] = b
    groups: dict[tuple[int, str], list[MemoryBreakdown]] = {}
    for (attempt, at, _rank), b in newest.items():
        groups.setdefault((attempt, at), []).append(b)
    return [fullest(groups[k]) for k in sorted(groups, key=lambda k: (k[0], k[1] == "peak"))]


def newest_attempt(values: Sequence[MemoryBreakdown]) -> list[MemoryBreakdown]:
    """Every rank's breakdown of the newest attempt that has one (the newest event per rank):
    what ``/metrics`` exports."""
    if not values:
        return []
    last = max(b.attempt for b in values)
    ranks: dict[int | None, MemoryBreakdown] = {}
    for b in values:
        if b.attempt == last:
            ranks[b.rank] = b
    return [ranks[r] for r in sorted(ranks, key=lambda r: -1 if r is None else r)]


def bars(journal: Journal) -> list[dict[str, Any]]:
    """The journal's breakdowns, one per attempt and moment (``per_attempt``), as status's JSON."""
    return [b.as_dict() for b in per_attempt(from_events(journal.events_of(EVENT)))]


def status_lines(shown: Sequence[Mapping[str, Any]]) -> list[str]:
    """At most two lines for ``oomguard status``, from status's bars (``bars``): the newest memory
    failure's breakdown and the newest attempt that fit, the two a user compares."""
    failure = next((b for b in reversed(shown) if b.get("at") != "peak"), None)
    fit = next((b for b in reversed(shown) if b.get("at") == "peak"), None)
    return [str(b["line"]) for b in (failure, fit) if b is not None and b.get("line")]
