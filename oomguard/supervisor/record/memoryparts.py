"""What filled memory, as the journal's ``memory_breakdown`` events say it: one typed value per event.

The probe (or, at a host or kernel OOM, the last reading before it) splits a rank's memory into the
parts a user knows: weights, gradients, optimizer state, activations and temporaries (the rest of
what the allocator or the process holds) and the allocator's cache (reserved but unallocated). The
event's format is fixed in docs/outputs.md; this module parses it once (``parse``) into
``MemoryBreakdown``, which status, the report, ``/metrics``, the notification and the dashboard render
in one wording (``line``). A part the event gives as null was not seen: it stays ``None`` here and is
said "not seen", never guessed.

``weights`` counts every parameter; ``frozen_weights`` is the share of them that trains not (no
gradient, no optimizer state: a LoRA fine-tune's base model), so it is said inside the weights.

Where two attempts at different micro-batches have breakdowns, ``memory_breakdown`` journals a
``memory_comparison`` ("activations 13.8 GiB at micro-batch 32, 6.9 GiB at 16: about 0.43 GiB a
sample; weights, gradients and AdamW state 2.0 GiB at both") and, where the fixed part alone leaves
less room under the limit than one sample's activations, says so and names what would change it
before halving down to 1 spends the restarts. A per-sample figure is a difference of two readings,
said "about".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from oomguard.supervisor.observe.allocator import BreakdownWatch
from oomguard.supervisor.units import format_size

EVENT = "memory_breakdown"
COMPARISON = "memory_comparison"
# The parts of a bar, bottom to top: what the model is, then what training adds, then what the
# allocator keeps for later. (key in the event, the words a user reads)
PARTS = (("weights", "weights"), ("gradients", "gradients"), ("optimizer_state", "optimizer state"),
         ("activations", "activations"), ("cache", "cache"))
AT_WORDS = {"oom": "at the OOM", "peak": "at its peak (it fit)", "last_reading": "last reading before the failure"}


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
class Stack:
    where: str
    bytes: int
    allocations: int


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
    baseline: int | None = None  # what the process held before the model (the host)
    snapshot: str | None = None  # the allocator's history, saved for PyTorch's memory viewer (CUDA)
    stacks: tuple[Stack, ...] = ()  # the largest allocations by stack (CUDA)

    @property
    def failed(self) -> bool:
        return self.at != "peak"

    def part(self, key: str) -> int | None:
        """A part's bytes by its key; None when it was not seen."""
        return next((p.bytes for p in self.parts if p.key == key), None)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form status, the API and the dashboard read (every part listed, null when not seen)."""
        return {**asdict(self), "parts": [asdict(p) for p in self.parts], "optimizers": list(self.optimizers),
                "processes": None if self.processes is None else [asdict(p) for p in self.processes],
                "stacks": [asdict(s) for s in self.stacks], "text": parts_text(self), "line": line(self)}


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
        processes=None if not isinstance(procs, list) else tuple(
            Process(int(r["pid"]), str(r.get("role") or "other"), str(r.get("name") or "?"), rss)
            for r in procs if isinstance(r, Mapping) and _size(r.get("pid")) is not None
            and (rss := _size(r.get("rss"))) is not None),
        baseline=_size(data.get("baseline")) or None, snapshot=str(data["snapshot"]) if data.get("snapshot") else None,
        stacks=tuple(Stack(str(s.get("where")), s["bytes"], s["allocations"]) for s in data.get("stacks") or ()
                     if isinstance(s, Mapping) and _size(s.get("bytes")) is not None
                     and _size(s.get("allocations")) is not None))


def from_events(events: Sequence[Mapping[str, Any]]) -> list[MemoryBreakdown]:
    """The breakdowns among journal events (rows with ``data`` and ``attempt``), oldest first."""
    found = (parse(e.get("data") or {}, e.get("attempt")) for e in events)
    return [b for b in found if b is not None]


# --- words ------------------------------------------------------------------------------------


def part_text(part: Part, value: MemoryBreakdown) -> str:
    """``optimizer state 2.4 GiB (AdamW)``, ``weights 1.2 GiB (0.9 GiB of them frozen)``, ``cache not seen``.
    On the host the activations at an OOM are read in the exception hook, once the error unwound the
    failed expression's temporaries: a lower bound, said so."""
    if part.bytes is None:
        return f"{part.label} not seen"
    unwound = part.key == "activations" and value.at == "oom" and value.device == "cpu"
    text = f"{part.label} {'at least ' if unwound else ''}{format_size(part.bytes)}"
    if unwound:
        text += " (read once the error unwound)"
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
    found: Counter[str] = Counter()
    for p in processes:
        found[p.role] += p.rss
    return found


def processes_text(processes: Sequence[Process]) -> str:
    """``trainer 1.1 GiB, 2 data-loader workers 0.6 GiB``: the reading per role, largest role first."""
    count = Counter(p.role for p in processes)
    return ", ".join(f"{count[role]} {role}s {format_size(rss)}" if count[role] > 1 else f"{role} {format_size(rss)}"
                     for role, rss in sorted(by_role(processes).items(), key=lambda kv: -kv[1]))


def parts_text(value: MemoryBreakdown) -> str:
    """``weights 1.2 GiB, gradients 1.2 GiB, optimizer state 2.4 GiB (AdamW), activations 13.8 GiB,
    cache not seen; limit 20.0 GiB (gpu)``; with the per-process reading where there is one."""
    seen = any(p.bytes is not None for p in value.parts)
    text = ", ".join(part_text(p, value) for p in value.parts) if seen else "no part seen"
    if value.baseline:
        text += f", held before the model {format_size(value.baseline)}"
    if value.processes:
        text += f"; by process: {processes_text(value.processes)}"
    return f"{text}; {limit_text(value)}"


def line(value: MemoryBreakdown) -> str:
    """One line for the notification and status: whose memory, when it was read (``attempt 3 at
    micro-batch 32, rank 0, at the OOM``), and its parts."""
    where = f"attempt {value.attempt}" + (f" at micro-batch {value.micro_batch}" if value.micro_batch else "")
    if value.rank is not None:
        where += f", rank {value.rank}"
    return f"{where}, {AT_WORDS[value.at]}: {parts_text(value)}"


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
    # a later event for the same rank and moment is the newer reading
    newest = {(b.attempt, b.at, b.rank): b for b in values}
    groups: dict[tuple[int, str], list[MemoryBreakdown]] = {}
    for (attempt, at, _rank), b in newest.items():
        groups.setdefault((attempt, at), []).append(b)
    return [fullest(groups[k]) for k in sorted(groups, key=lambda k: (k[0], k[1] == "peak"))]


def newest_attempt(values: Sequence[MemoryBreakdown]) -> list[MemoryBreakdown]:
    """Every rank's breakdown of the newest attempt that has one (the newest event per rank):
    what ``/metrics`` exports."""
    last = max((b.attempt for b in values), default=None)
    ranks = {b.rank: b for b in values if b.attempt == last}
    return [ranks[r] for r in sorted(ranks, key=lambda r: -1 if r is None else r)]


def status_lines(shown: Sequence[Mapping[str, Any]]) -> list[str]:
    """At most two lines for ``oomguard status``, from status's bars (``per_attempt``): the newest memory
    failure's breakdown and the newest attempt that fit, the two a user compares."""
    failure = next((b for b in reversed(shown) if b.get("at") != "peak"), None)
    fit = next((b for b in reversed(shown) if b.get("at") == "peak"), None)
    return [str(b["line"]) for b in (failure, fit) if b is not None and b.get("line")]


# --- the failed attempt beside another, and the report's lines --------------------------------


def _fixed(value: MemoryBreakdown) -> int | None:
    """Weights, gradients and optimizer state together; None where one of them was not seen."""
    parts = [value.part(k) for k in ("weights", "gradients", "optimizer_state")]
    return None if None in parts else sum(p or 0 for p in parts)


def state_words(value: MemoryBreakdown) -> str:
    return f"{' and '.join(value.optimizers)} state" if value.optimizers else "optimizer state"


def representative(values: Sequence[MemoryBreakdown], attempt: int) -> MemoryBreakdown | None:
    """The attempt's breakdown of its lowest rank (the one with activations: a probe's, not a reading)."""
    mine = [b for b in values if b.attempt == attempt and b.part("activations") is not None]
    return min(mine, key=lambda b: b.rank or 0, default=None)


@dataclass(frozen=True)
class Comparison:
    """As the ``memory_comparison`` event holds it (``asdict``)."""

    failed_attempt: int
    other_attempt: int
    text: str
    per_sample_bytes: int | None
    no_room: bool


def compare(failed: MemoryBreakdown, other: MemoryBreakdown | None,
            fallback_args: Sequence[str] = ()) -> Comparison | None:
    """The failed attempt's breakdown beside ``other`` (an attempt that fit, else an earlier failure)."""
    m1, a1 = failed.micro_batch, failed.part("activations")
    if m1 is None or a1 is None or m1 < 1:
        return None
    # On the host the figure is read in the exception hook, once the error unwound the failed expression's
    # temporaries: what was held at the failure was at least that much, and so is a slope from it.
    least = "at least " if failed.device == "cpu" else ""
    per_sample, text = a1 // m1, f"activations {least}{format_size(a1)} at micro-batch {m1}"
    m2 = other.micro_batch if other else None
    a2 = other.part("activations") if other else None
    if m2 is not None and a2 is not None and m2 != m1:
        text += f", {format_size(a2)} at {m2}"
        if (a1 - a2) * (m1 - m2) > 0:
            per_sample = (a1 - a2) // (m1 - m2)
            text += f": {least or 'about '}{format_size(per_sample)} a sample"
        else:  # the failure came early in its step: what it held then says nothing of a sample
            per_sample = 0
            text += " (the failed attempt held no more when it failed: no per-sample figure)"
    else:
        other = None
        text += f": {least or 'about '}{format_size(per_sample)} a sample"
    text += _fixed_text(failed, other)
    # What the limit leaves for activations once the fixed part (its largest reading: an OOM in the
    # first step comes before the optimizer's state exists) and the host's baseline are held.
    fixed = max(x for x in (_fixed(failed), _fixed(other) if other else None, 0) if x is not None)
    room = None if failed.limit is None or not fixed else failed.limit - fixed - (failed.baseline or 0)
    no_room = room is not None and per_sample > 0 and room < per_sample
    if no_room and room is not None:
        text += _no_room_text(failed, room, per_sample, fallback_args)
    return Comparison(failed.attempt, other.attempt if other else failed.attempt, text, per_sample, no_room)


def _fixed_text(failed: MemoryBreakdown, other: MemoryBreakdown | None) -> str:
    f1 = _fixed(failed)
    if f1 is None:
        return ""
    words = f"weights, gradients and {state_words(other or failed)}"
    f2 = _fixed(other) if other else None
    if other is None:
        return f"; {words} {format_size(f1)}"
    if f2 is not None and abs(f1 - f2) <= max(f1, f2) // 100:
        return f"; {words} {format_size(max(f1, f2))} at both"
    seen = format_size(f2) if f2 is not None else "not seen"
    return f"; {words} {format_size(f1)} at {failed.micro_batch}, {seen} at {other.micro_batch}"


def _no_room_text(failed: MemoryBreakdown, room: int, per_sample: int, fallback_args: Sequence[str]) -> str:
    base = failed.baseline
    held = f" and {format_size(base)} the process held before the model" if base else ""
    change = (f"the fallback arguments ({' '.join(fallback_args)}, --fallback-args)" if fallback_args else
              "gradient checkpointing, an 8-bit optimizer or frozen weights (--fallback-args adds such an "
              "argument once the micro-batch is at its floor)")
    left = format_size(room) if room > 0 else f"nothing ({format_size(-room)} over)"
    return (f". The fixed part alone leaves no room for one sample: under the {format_size(failed.limit or 0)} "
            f"limit, weights, gradients and {state_words(failed)}{held} leave {left}, less than one sample's "
            f"activations (about {format_size(per_sample)}); a smaller micro-batch will not fit. What would change "
            f"these figures: {change}")


def memory_breakdown(watch: BreakdownWatch, kind: str | None, attempt: int, micro_batch: int | None,
                     event: Callable[..., None], fallback_args: Sequence[str], say: Callable[[str], None]) -> None:
    """At an attempt's end (run/attempt.py): journal its breakdowns and, where there is one, the
    comparison with the attempts this supervisor saw before (journaled, and said in its log)."""
    mine = [b for b in map(parse, watch.ended(kind, attempt, micro_batch, event)) if b is not None]
    seen = [b for b in map(parse, watch.history) if b is not None]
    if not mine:
        return
    failed = [b for b in seen if b.at == "oom"]
    if mine[0].at == "oom":  # this attempt failed: beside the last one that fit, else the last failure
        this = representative(mine, attempt)
        fits = [b for b in seen if b.at == "peak" and b.micro_batch != micro_batch]
        others = fits or [b for b in failed if b.attempt != attempt and b.micro_batch != micro_batch]
        other = representative(others, others[-1].attempt) if others else None
    elif mine[0].at == "peak" and failed:  # this one fit: beside the last failure
        this = representative(failed, failed[-1].attempt)
        other = representative(mine, attempt)
    else:
        return
    comparison = compare(this, other, fallback_args) if this is not None else None
    if comparison is None:
        return
    event(COMPARISON, **asdict(comparison))
    say(f"memory: {comparison.text}")


def annotate(failures: list[dict[str, Any]], breakdowns: Sequence[MemoryBreakdown],
             comparisons: Sequence[Mapping[str, Any]]) -> None:
    """Each failure of the report gets ``memory``: its breakdowns (status's JSON of them) and the
    comparison that names it."""
    found = {c.get("failed_attempt"): dict(c) for c in comparisons}
    for failure in failures:
        mine = [b.as_dict() for b in breakdowns if b.attempt == failure["attempt"] and b.failed]
        if mine or failure["attempt"] in found:
            failure["memory"] = {"breakdowns": mine, "comparison": found.get(failure["attempt"])}


def lines(failure: dict[str, Any]) -> list[str]:
    """The report's lines for one failure's ``memory`` (none where it has none): status's line of
    each rank, then the snapshot and the largest allocations where they were recorded."""
    memory = failure.get("memory")
    if not memory:
        return []
    out: list[str] = []
    for b in memory["breakdowns"]:
        out.append(f"    memory:   {b['line']}")
        if b["snapshot"]:
            out.append(f"    snapshot: {b['snapshot']} (open it in https://pytorch.org/memory_viz)")
        out += [f"      {format_size(s['bytes'])} in {s['allocations']} allocations at {s['where']}"
                for s in b["stacks"]]
    if memory.get("comparison"):
        out.append(f"    across:   {memory['comparison']['text']}")
    return out
