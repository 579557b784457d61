"""Blame the batch only for what the batch did: the cause of one memory failure, from the record.

``attribute`` names the cause from the attempt's memory readings with its steps, the readings counted
against the limit that applied (``Limit``), the evidence in its output and the memory model's view
of the batch, most specific first: data loader, leak, phase spike, per-sample (the causes, their
evidence and remedies: docs/failures.md, "Causes of a memory failure"). A rise is a leak only when
its line, extended to the failure, reaches the limit; a line far below it did not kill the worker,
a spike above it did. A reading at or just before a failure is a lower bound, never a plateau
(``Plateau.censored``): no line infers from it how memory scales with the batch. Pure: the tests
feed it scripted series.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from oomguard.supervisor.observe.allocator import AllocatorOom, OomProgress
from oomguard.supervisor.observe.output import Phase, phase_of
from oomguard.supervisor.sizing.memmodel import Fit, Point, fit
from oomguard.supervisor.sizing.trend import Headroom, Reading, Trend, steady_rise
from oomguard.supervisor.units import MIB, format_size


class Cause(enum.Enum):
    PER_SAMPLE = "per_sample"
    LEAK = "leak"
    EVALUATION = "evaluation"
    SAVING = "checkpoint_saving"
    LOADING = "checkpoint_loading"
    DATA_LOADER = "data_loader"

    @property
    def fits_model(self) -> bool:
        """Does an attempt with this cause say anything about memory per sample? A leak's peak is
        where the leak got to, a phase's is that phase's: neither enters the fit."""
        return self in (Cause.PER_SAMPLE, Cause.DATA_LOADER)


_PHASE_CAUSE = {Phase.EVALUATION: Cause.EVALUATION, Phase.SAVING: Cause.SAVING, Phase.LOADING: Cause.LOADING}
# How much higher the plateau at the largest micro-batch must be than at the smallest for memory to
# follow the micro-batch: more than a sampling jitter of a few percent, far less than the share a
# batch twice the size adds when it is what fills memory.
FOLLOW_MARGIN = 0.05


@dataclass(frozen=True)
class Evidence:
    """What the attempt left behind, beside its memory readings."""

    frames: Sequence[str] = ()  # function names of the newest traceback, outermost first
    tail: Sequence[str] = ()  # the last lines of output
    dataloader: str | None = None  # the line saying a DataLoader worker died
    capacity: int | None = None  # the per-process cap its CUDA OOM message names ("23.75 GiB allowed")
    allocator: AllocatorOom | None = None  # the probe's figures at the CUDA OOM
    step_peaks: Mapping[int, int] = field(default_factory=dict)  # micro-batch -> allocator's step peak there
    # The probe's figures at a host OOM under RLIMIT_AS: the limit the failure met, which no reading
    # from outside counts (the cgroup's and the host's memory were not what ran out).
    address_space: OomProgress | None = None


@dataclass(frozen=True)
class Limit:
    """The limit that applied at the failure, the readings counted against it, and when (None: the last reading)."""

    budget: str
    bytes: int
    readings: Sequence[Reading]
    failed_at: float | None = None

    def headroom(self) -> Headroom | None:
        """The trend of the counted memory at the failure, against the limit; None without a trend."""
        trend = steady_rise(self.readings)
        if trend is None:
            return None
        at = self.failed_at if self.failed_at is not None else self.readings[-1].t
        return Headroom(self.budget, self.bytes, trend, max(at, trend.t_last))


class Plateau(NamedTuple):
    """The highest reading of an attempt at one micro-batch; ``censored`` when a memory failure ended
    the attempt (the need was at least this, maybe far more)."""

    micro_batch: int
    bytes: int
    censored: bool = True


@dataclass(frozen=True)
class Attribution:
    cause: Cause
    summary: str  # one line for the journal, status, report and dashboard
    figures: dict[str, Any] = field(default_factory=dict)  # what decided it
    also: Cause | None = None  # a second cause present in the same failure (a leak that also spiked)

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause.value, "summary": self.summary, **self.figures,
                **({"also": self.also.value} if self.also else {})}


def attribute(readings: Sequence[Reading], evidence: Evidence, micro_batch: int,
              what: str = "worker RSS", model: Fit | None = None, limit: Limit | None = None,
              earlier: Sequence[Plateau] = (), failed: bool = True) -> Attribution:
    """The cause of a memory failure at ``micro_batch`` (``what``: the memory the readings count). A rise
    is a leak only if its line reaches ``limit`` (None: none known, or no failure to explain);
    ``failed``: a memory failure ended the attempt, so its readings are lower bounds."""
    # All-0 readings did not see the worker's memory (NVML without per-process figures): no readings, no limit.
    blind = bool(readings) and not any(r.used for r in readings)
    if blind:
        readings, limit = (), None
    elif limit is not None and not any(r.used for r in limit.readings):
        limit = None
    trend = steady_rise(readings)
    room = limit.headroom() if limit is not None else None
    figures = {**_trend_figures(trend), **_room_figures(room)}
    phase = phase_of(evidence.frames, evidence.tail)
    if evidence.dataloader:
        line = evidence.dataloader.strip().rstrip(".")
        return Attribution(Cause.DATA_LOADER, f"a DataLoader worker died ({line}){_spike(None, room)}",
                           {**figures, "evidence": line})
    if trend is not None and trend.steady():
        met = f"; {_address_space_line(evidence.address_space)}" if evidence.address_space else ""
        found = _rising(trend, room, phase, micro_batch, what, {**figures, **_address_space_figures(
            evidence.address_space)}, met)
        if found is not None:
            return found
    spike = _probe_words(evidence, micro_batch, figures, _spike(trend, room))
    if phase is not None:
        return Attribution(_PHASE_CAUSE[phase[0]], f"memory ran out during {phase[0].value} ({phase[1]}){spike}",
                           {**figures, "evidence": phase[1]})
    if evidence.allocator is not None:
        return Attribution(Cause.PER_SAMPLE, spike[2:], figures)
    if blind:
        figures["unseen"] = what
        spike = f"; the {what} readings saw none of its memory (all 0){spike}"
    return _per_sample(readings, trend, micro_batch, what, model, figures, spike, earlier, failed, limit)


def _probe_words(evidence: Evidence, micro_batch: int, figures: dict[str, Any], spike: str) -> str:
    """The probe's figures where it caught the failure, added to ``figures``; its words replace the
    readings' (``spike``): the allocator's own figures say more than any reading from outside."""
    if (rlimit := evidence.address_space) is not None:
        figures.update(_address_space_figures(rlimit))
        spike = f"; {_address_space_line(rlimit)}"
    if (alloc := evidence.allocator) is not None:
        figures.update(_allocator_figures(alloc, micro_batch, evidence.step_peaks))
        spike = f"; {_allocator_line(alloc, micro_batch, figures)}"
    return spike


def _rising(trend: Trend, room: Headroom | None, phase: tuple[Phase, str] | None, micro_batch: int, what: str,
            figures: dict[str, Any], met: str) -> Attribution | None:
    """Memory rose steadily: a leak when its line explains the failure, a leak that also spiked when
    the rise used as much room as the jump needed; None when the jump alone is to blame. ``met``: the
    limit the failure met, where its figures come from the probe and no reading counts against it."""
    where = f"; it failed in {phase[0].value} ({phase[1]})" if phase else ""
    rate = f"{trend.describe(what)} while training at micro-batch {micro_batch}"
    if room is None:  # nothing to measure the line against: it stands on its own readings
        return None if trend.jump else Attribution(Cause.LEAK, f"leak: {rate}{met}{where}", figures)
    jump = room.trend.jump
    if room.reached and jump is None:
        return Attribution(Cause.LEAK, f"leak: {rate}, and {room.describe()}{where}", figures)
    # Something came on top of the line. Restarting fresh at the same size gives back what the line
    # added in this attempt; the jump needed at least the distance left (and at least what a reading
    # saw of it). When the rise gave back at least that, the fresh attempt has twice the room the
    # jump is known to need: the leak's remedy is supported. Else only a smaller batch makes room.
    if room.rise < room.needed:
        return None
    spike = _PHASE_CAUSE[phase[0]] if phase else Cause.PER_SAMPLE
    seen = f" (a reading saw {format_size(jump.above)} above it)" if jump else ""
    return Attribution(
        Cause.LEAK,
        f"leak and a spike: {rate}; {room.describe()}, and memory jumped above that rise{seen}{where}; the leak "
        f"added {format_size(room.rise)} in this attempt, at least the {format_size(room.needed)} the jump needed "
        "on top of it, so a fresh restart at the same size has room for the spike",
        figures, also=spike)


def _spike(trend: Trend | None, room: Headroom | None) -> str:
    """The figures of a failure the line does not explain: where the line was, how far it rose."""
    if room is None:
        return ""
    jump = room.trend.jump
    text = f"; {room.describe()}"
    if jump is not None:
        text += f", and memory jumped {format_size(jump.above)} above it"
    elif not room.reached:
        text += ", so the memory that reached the limit came between two readings"
    if trend is not None and trend.steady() and not room.falling_below_zero:  # a rise that did not reach it
        text += (f"; the rise added only {format_size(room.rise)} in this attempt, less than the "
                 f"{format_size(room.needed)} the jump needed on top of it, "
                 "so the jump, not the rise, reached the limit")
    return text


def _per_sample(readings: Sequence[Reading], trend: Trend | None, micro_batch: int, what: str,
                model: Fit | None, figures: dict[str, Any], spike: str,
                earlier: Sequence[Plateau], failed: bool, limit: Limit | None) -> Attribution:
    """The batch is blamed: the figures a user recognizes first (what the micro-batch needed, the
    limit), then why nothing else was (the trend's statistics stay in ``figures``)."""
    if trend is None:
        why = "too few readings to tell whether memory was rising"
    elif trend.steady():
        why = f"{trend.describe(what)}, then jumped"
    else:
        why = "memory did not keep rising after warm-up"
    need = f"micro-batch {micro_batch}"
    if readings:
        figures["plateau_bytes"] = max(r.used for r in readings)
        figures["plateau_censored"] = failed
        need += (f" needed at least {format_size(figures['plateau_bytes'])} (the highest {what} reading before "
                 "it failed: a lower bound)" if failed else f" used {format_size(figures['plateau_bytes'])} at "
                 f"its highest {what} reading")
    else:
        need += " ran out of memory" if failed else " left no reading"
    if limit is not None and "below_limit_bytes" not in figures:  # else the trend's words below name it
        need += f"; the limit was {format_size(limit.bytes)} ({limit.budget})"
    if model is not None and model.points >= 2:  # a line through two sizes or more: the scaling is measured
        figures["per_sample_bytes"] = round(model.per_sample_bytes)
        return Attribution(Cause.PER_SAMPLE, f"{need}; {why}{spike}; the memory model measured "
                           f"{format_size(model.per_sample_bytes)} a sample: memory follows the micro-batch", figures)
    return Attribution(Cause.PER_SAMPLE, _scaling(f"{need}; {why}{spike}", micro_batch, figures, earlier), figures)


def _scaling(why: str, micro_batch: int, figures: dict[str, Any], earlier: Sequence[Plateau]) -> str:
    """The per-sample summary, saying what the highest readings at each size show about the batch:
    only measured ones can show it; lower bounds (read before a failure) are listed as such."""
    sizes = {q.micro_batch: q for q in (Plateau(*p) for p in earlier)}
    if figures.get("plateau_bytes"):
        sizes[micro_batch] = Plateau(micro_batch, figures["plateau_bytes"], figures.get("plateau_censored", True))
    if len(sizes) < 2:
        return f"{why}; no evaluation or checkpoint step was seen, so the batch is taken as the cause; only " \
               f"micro-batch {micro_batch} measured so far"
    ordered = sorted(sizes.values(), reverse=True)  # the largest first: the order halving goes
    figures["plateaus"] = {str(p.micro_batch): p.bytes for p in ordered}
    if any(p.censored for p in ordered):
        figures["follows"] = None
        bounds = ", ".join(f"{'at least ' if p.censored else ''}{format_size(p.bytes)} at {p.micro_batch}"
                           for p in ordered)
        return (f"{why}; no evaluation or checkpoint step was seen, so the batch is taken as the cause; the "
                f"readings before a memory failure are lower bounds ({bounds}), so they cannot tell how memory "
                "scales with the micro-batch")
    listed = ", ".join(f"{format_size(p.bytes)} at {p.micro_batch}" for p in ordered)
    largest, smallest = ordered[0].bytes, ordered[-1].bytes
    figures["follows"] = largest > smallest * (1 + FOLLOW_MARGIN)
    if figures["follows"]:
        return f"{why}; memory follows the micro-batch (highest readings {listed})"
    moved = "grew as the micro-batch shrank" if largest < smallest else "stayed level as the micro-batch shrank"
    return (f"{why}, and no evaluation or checkpoint step was seen; but memory does not follow the micro-batch: "
            f"its highest readings {moved} ({listed})")


def earlier_plateaus(attributions: Mapping[int, Mapping[str, Any]],
                     attempts: Sequence[Mapping[str, Any]]) -> list[Plateau]:
    """The plateau of each earlier attempt attributed with one (the journal's ``attribution`` events);
    one recorded before plateaus were marked is a failure's, so censored."""
    micro = {a["attempt"]: a["micro_batch"] for a in attempts}
    return [Plateau(micro[n], int(data["plateau_bytes"]), bool(data.get("plateau_censored", True)))
            for n, data in sorted(attributions.items()) if data.get("plateau_bytes") and n in micro]


def step_peaks(attempts: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """micro-batch -> the highest allocator step peak the probe measured there (each completed step
    measures what its size needs, even in an attempt that failed later)."""
    peaks: dict[int, int] = {}
    for row in attempts:
        if row.get("peak_allocated"):
            peaks[row["micro_batch"]] = max(peaks.get(row["micro_batch"], 0), int(row["peak_allocated"]))
    return peaks


def _allocator_line(alloc: AllocatorOom, micro_batch: int, figures: Mapping[str, Any]) -> str:
    """``micro-batch 256 needed at least 78.7 GiB: it asked for 1.1 GiB more with 77.6 GiB allocated;
    the limit was 79.2 GiB; at most 290.0 MiB a sample, measured at 128``."""
    micro = alloc.micro_batch or micro_batch
    if alloc.requested is not None and alloc.allocated is not None:
        text = (f"micro-batch {micro} needed at least {format_size(alloc.allocated + alloc.requested)}: it asked "
                f"for {format_size(alloc.requested)} more with {format_size(alloc.allocated)} allocated")
    elif alloc.requested is not None:
        text = f"micro-batch {micro} asked for {format_size(alloc.requested)} more, which did not fit"
    else:
        text = f"an allocation failed at micro-batch {micro}" + (
            f" with {format_size(alloc.allocated)} allocated" if alloc.allocated is not None else "")
    if alloc.limit is not None:
        text += f"; the limit was {format_size(alloc.limit)}" + (
            f" ({alloc.fraction:.0%} of the device)" if alloc.fraction else "")
    if unallocated := alloc.reserved_unallocated:
        text += f"; {format_size(unallocated)} more was reserved but unallocated"
    if (per_sample := figures.get("per_sample_bytes")) is not None:
        sizes = " and ".join(str(m) for m in sorted(figures["measured_at"], reverse=True))
        # One size cannot part fixed memory from per-sample memory: its peak over its samples is a ceiling.
        most = "at most " if len(figures["measured_at"]) == 1 else "about "
        text += f"; {most}{format_size(per_sample)} a sample, measured at {sizes}"
    return text


def _address_space_line(oom: OomProgress) -> str:
    """``an allocation of 64 MiB failed against the 1192 MiB address-space limit (RLIMIT_AS); 1150 MiB
    was mapped when the error was seen``: the probe's figures at a host OOM under ``RLIMIT_AS``."""
    what = f"an allocation of {oom.requested / MIB:.0f} MiB" if oom.requested is not None else "an allocation"
    text = f"{what} failed against the {oom.limit / MIB:.0f} MiB address-space limit (RLIMIT_AS)" \
        if oom.limit else f"{what} failed against the address-space limit (RLIMIT_AS)"
    if oom.held is not None:
        text += f"; {oom.held / MIB:.0f} MiB was mapped when the error was seen"
    return text


def _address_space_figures(oom: OomProgress | None) -> dict[str, Any]:
    if oom is None:
        return {}
    return {"budget": "address space (RLIMIT_AS)", "limit_bytes": oom.limit, "requested_bytes": oom.requested,
            "mapped_bytes": oom.held, "source": "probe"}


def _allocator_figures(alloc: AllocatorOom, micro_batch: int, step_peaks: Mapping[int, int]) -> dict[str, Any]:
    """The allocator's figures at the OOM, and the per-sample memory its step peaks at the other
    micro-batches measured (from one size, the peak over its samples: errs high)."""
    figures: dict[str, Any] = {"source": "allocator", "requested_bytes": alloc.requested,
                               "allocated_bytes": alloc.allocated, "reserved_bytes": alloc.reserved,
                               "limit_bytes": alloc.limit, "fraction": alloc.fraction}
    others = {m: b for m, b in step_peaks.items() if m != (alloc.micro_batch or micro_batch) and b > 0}
    line = fit(Point(m, b, True) for m, b in others.items())
    if line is not None:
        figures["per_sample_bytes"] = round(line.per_sample_bytes)
        figures["measured_at"] = sorted(others, reverse=True)
    return figures


def _trend_figures(trend: Trend | None) -> dict[str, Any]:
    if trend is None:
        return {}
    return {"bytes_per_s": round(trend.per_s), "bytes_per_step": None if trend.per_step is None
            else round(trend.per_step), "r2": round(trend.r2, 3), "samples": trend.readings,
            "span_s": round(trend.span_s, 1), "steps": trend.steps}


def _room_figures(room: Headroom | None) -> dict[str, Any]:
    """The line against the limit at the failure: what a person needs to see why it was, or was
    not, a leak (the keys of status --json, the report and the notification)."""
    if room is None:
        return {}
    steps = room.steps
    jump = room.trend.jump
    # A line carried below 0 is no memory: neither it nor its distance to the limit is a figure.
    falling = room.falling_below_zero
    return {"budget": room.budget, "limit_bytes": room.limit,
            "trend_at_failure_bytes": None if falling else room.expected,
            "below_limit_bytes": None if falling else room.distance, "tolerance_bytes": room.tolerance,
            "noise_bytes": round(room.trend.noise), "rise_bytes": None if falling else room.rise,
            "seconds_to_limit": round(room.seconds, 1) if room.seconds != float("inf") else None,
            "steps_to_limit": None if steps is None else round(steps),
            "jump_bytes": jump.above if jump else None}
