"""What filled memory, in words, and the failed attempt beside another: the report's and the cause's lines.

``after_attempt`` journals an attempt's ``memory_breakdown`` events (observe/breakdown.py) and, where
two attempts at different micro-batches have them, a ``memory_comparison``: the activations at each
and what one sample adds, the fixed part (weights, gradients, optimizer state) at both, e.g.
"activations 13.8 GiB at micro-batch 32, 6.9 GiB at 16: about 0.43 GiB a sample; weights, gradients
and AdamW state 2.0 GiB at both". Where the fixed part alone leaves less room under the limit than
one sample's activations, it says so with the figures, and names what would change them, before
halving down to 1 spends the restarts. Every figure is the allocator's or the optimizer's (or the
process's own memory on the host); a per-sample figure is a difference of two of them, said "about".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from oomguard.supervisor.observe.allocator import EVENT, BreakdownWatch
from oomguard.supervisor.units import format_size

COMPARISON = "memory_comparison"


def _fixed(event: dict[str, Any]) -> int | None:
    parts = [event.get(k) for k in ("weights", "gradients", "optimizer_state")]
    return sum(p for p in parts if isinstance(p, int)) if all(isinstance(p, int) for p in parts) else None


def state_words(event: dict[str, Any]) -> str:
    names = event.get("optimizers") or []
    return f"{' and '.join(names)} state" if names else "optimizer state"


def representative(events: Sequence[dict[str, Any]], attempt: int) -> dict[str, Any] | None:
    """The attempt's breakdown of its lowest rank (the one with activations: a probe's, not a reading)."""
    mine = [e for e in events if e.get("attempt") == attempt and isinstance(e.get("activations"), int)]
    return min(mine, key=lambda e: e.get("rank") or 0, default=None)


@dataclass(frozen=True)
class Comparison:
    failed: int
    other: int
    text: str
    per_sample: int | None
    no_room: bool

    def data(self) -> dict[str, Any]:
        return {"failed_attempt": self.failed, "other_attempt": self.other, "text": self.text,
                "per_sample_bytes": self.per_sample, "no_room": self.no_room}


def compare(failed: dict[str, Any], other: dict[str, Any] | None,
            fallback_args: Sequence[str] = ()) -> Comparison | None:
    """The failed attempt's breakdown beside ``other`` (an attempt that fit, else an earlier failure)."""
    m1, a1 = failed.get("micro_batch"), failed.get("activations")
    if not isinstance(m1, int) or not isinstance(a1, int) or m1 < 1:
        return None
    # On the host the figure is read in the exception hook, once the error unwound the failed expression's
    # temporaries: what was held at the failure was at least that much, and so is a slope from it.
    least = "at least " if failed.get("device") == "cpu" else ""
    per_sample, text = a1 // m1, f"activations {least}{format_size(a1)} at micro-batch {m1}"
    m2 = other.get("micro_batch") if other else None
    a2 = other.get("activations") if other else None
    if other is not None and isinstance(m2, int) and isinstance(a2, int) and m2 != m1:
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
    room = _room(failed, other)
    no_room = room is not None and per_sample > 0 and room < per_sample
    if no_room and room is not None:
        text += _no_room_text(failed, room, per_sample, fallback_args)
    return Comparison(failed["attempt"], other["attempt"] if other else failed["attempt"], text, per_sample, no_room)


def _fixed_text(failed: dict[str, Any], other: dict[str, Any] | None) -> str:
    f1 = _fixed(failed)
    if f1 is None:
        return ""
    words = f"weights, gradients and {state_words(other or failed)}"
    f2 = _fixed(other) if other else None
    if other is None:
        return f"; {words} {format_size(f1)}"
    if f2 is not None and abs(f1 - f2) <= max(f1, f2) // 100:
        return f"; {words} {format_size(max(f1, f2))} at both"
    return f"; {words} {format_size(f1)} at {failed['micro_batch']}, {_size(f2)} at {other['micro_batch']}"


def _size(value: int | None) -> str:
    return format_size(value) if value is not None else "not seen"


def _room(failed: dict[str, Any], other: dict[str, Any] | None) -> int | None:
    """What the limit leaves for activations once the fixed part (its largest reading: an OOM in the
    first step comes before the optimizer's state exists) and the host's baseline are held."""
    limit = failed.get("limit")
    fixed = max(x for x in (_fixed(failed), _fixed(other) if other else None, 0) if x is not None)
    if not isinstance(limit, int) or not fixed:
        return None
    return limit - fixed - (failed.get("baseline") or 0)


def _no_room_text(failed: dict[str, Any], room: int, per_sample: int, fallback_args: Sequence[str]) -> str:
    base = failed.get("baseline")
    held = f" and {format_size(base)} the process held before the model" if base else ""
    change = (f"the fallback arguments ({' '.join(fallback_args)}, --fallback-args)" if fallback_args else
              "gradient checkpointing, an 8-bit optimizer or frozen weights (--fallback-args adds such an "
              "argument once the micro-batch is at its floor)")
    left = format_size(room) if room > 0 else f"nothing ({format_size(-room)} over)"
    return (f". The fixed part alone leaves no room for one sample: under the {format_size(failed['limit'])} limit, "
            f"weights, gradients and {state_words(failed)}{held} leave {left}, less than one sample's activations "
            f"(about {format_size(per_sample)}); a smaller micro-batch will not fit. What would change these "
            f"figures: {change}")


def after_attempt(watch: BreakdownWatch, kind: str | None, attempt: int, micro_batch: int | None,
                  event: Callable[..., None], fallback_args: Sequence[str] = ()) -> str | None:
    """Journal the attempt's breakdowns and, where there is one, the comparison (journaled, returned
    for the supervisor's log) with the attempts this supervisor saw before."""
    mine = watch.ended(kind, attempt, micro_batch, event)
    events = watch.history
    if not mine:
        return None
    failed = [e for e in events if e.get("at") == "oom"]
    if mine[0]["at"] == "oom":  # this attempt failed: beside the last one that fit, else the last failure
        this = representative(mine, attempt)
        fits = [e for e in events if e.get("at") == "peak" and e.get("micro_batch") != micro_batch]
        others = fits or [e for e in failed if e.get("attempt") != attempt and e.get("micro_batch") != micro_batch]
        other = representative(others, others[-1]["attempt"]) if others else None
    elif mine[0]["at"] == "peak" and failed:  # this one fit: beside the last failure
        this = representative(failed, failed[-1]["attempt"])
        other = representative(mine, attempt)
    else:
        return None
    comparison = compare(this, other, fallback_args) if this is not None else None
    if comparison is None:
        return None
    event(COMPARISON, **comparison.data())
    return f"memory: {comparison.text}"


def breakdown_text(event: dict[str, Any]) -> str:
    """One rank's breakdown in a line."""
    who = f"rank {event['rank']}" if event.get("rank") is not None else event.get("device") or "?"
    if event.get("at") == "last_reading":
        procs = ", ".join(f"{p['role']} {p['pid']} ({p['name']}) {format_size(p['rss'])}"
                          for p in event.get("processes") or [])
        limit = f" of the {format_size(event['limit'])} {event['limit_kind']} limit" if event.get("limit") else ""
        return f"last reading before the kill: {_size(event.get('total'))}{limit}: {procs}"
    frozen = f" ({format_size(event['frozen_weights'])} of them frozen)" if event.get("frozen_weights") else ""
    unwound = event.get("at") == "oom" and event.get("device") == "cpu" and event.get("activations") is not None
    activations = (f"activations at least {_size(event.get('activations'))} (read once the error unwound)" if unwound
                   else f"activations {_size(event.get('activations'))}")
    parts = [f"weights {_size(event.get('weights'))}{frozen}", f"gradients {_size(event.get('gradients'))}",
             f"{state_words(event)} {_size(event.get('optimizer_state'))}", activations]
    if event.get("cache") is not None:
        parts.append(f"cache {format_size(event['cache'])}")
    if event.get("baseline"):
        parts.append(f"before the model {format_size(event['baseline'])}")
    limit = f" of the {format_size(event['limit'])} {event.get('limit_kind') or ''} limit" if event.get("limit") else ""
    return f"{who} at the {'OOM' if event.get('at') == 'oom' else 'peak'}: {', '.join(parts)}{limit}"


def annotate(failures: list[dict[str, Any]], events: Sequence[dict[str, Any]]) -> None:
    """Each failure of the report gets ``memory``: its breakdowns, the largest allocations by stack
    (CUDA, where the allocator's history was recorded) and the comparison naming it."""
    rows = [{**e["data"], "attempt": e["data"].get("attempt", e.get("attempt"))} for e in events
            if e.get("kind") == EVENT]
    comparisons = {e["data"].get("failed_attempt"): e["data"] for e in events if e.get("kind") == COMPARISON}
    for failure in failures:
        mine = [r for r in rows if r.get("attempt") == failure["attempt"] and r.get("at") != "peak"]
        found = comparisons.get(failure["attempt"])
        if mine or found:
            failure["memory"] = {"breakdowns": mine, "comparison": found}


def lines(failure: dict[str, Any]) -> list[str]:
    """The report's lines for one failure's ``memory`` (none where it has none)."""
    memory = failure.get("memory")
    if not memory:
        return []
    out = [f"    memory:   {breakdown_text(e)}" for e in memory["breakdowns"]]
    for e in memory["breakdowns"]:
        if e.get("snapshot"):
            out.append(f"    snapshot: {e['snapshot']} (open it in https://pytorch.org/memory_viz)")
        out += [f"      {format_size(s['bytes'])} in {s['allocations']} allocations at {s['where']}"
                for s in e.get("stacks") or []]
    if memory.get("comparison"):
        out.append(f"    across:   {memory['comparison']['text']}")
    return out


def memory_breakdown(watch: BreakdownWatch, kind: str | None, attempt: int, micro_batch: int | None,
                     event: Callable[..., None], fallback_args: Sequence[str], say: Callable[[str], None]) -> None:
    """At an attempt's end (run/loop.py): journal what filled memory; say the comparison where there is one."""
    line = after_attempt(watch, kind, attempt, micro_batch, event, fallback_args)
    if line is not None:
        say(line)
