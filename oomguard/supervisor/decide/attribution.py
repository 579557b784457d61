"""Blame the batch only for what the batch did: the cause of one memory failure, from the record.

``attribute`` names the cause of an attempt's memory failure from what oomguard recorded about it:
its memory readings with the steps (the journal's samples), the evidence in its output (the
traceback's function names, the last lines, a DataLoader worker's death) and the memory model's
view of the batch. The causes, most specific first:

- *data loader*: a DataLoader worker process died (the OOM killer's favourite victim: the biggest
  process in the cgroup); the remedy starts with the workers, not the batch;
- *leak*: memory kept rising in a straight line while training went on at one size; the batch is
  not to blame, a restart from the newest checkpoint at the same size is;
- *phase spike*: the traceback or the last output names evaluation, checkpoint saving or loading;
- *per-sample*: none of the above; memory rose to a plateau that scales with the micro-batch,
  today's remedy (halve) is right. The summary says "memory follows the micro-batch" only where
  the figures show it: the memory model's line through two sizes or more, or this run's plateaus at
  two sizes or more, higher at the larger one (by ``FOLLOW_MARGIN``). Plateaus that grew as the
  batch shrank (301 MiB at 128, 377 at 64, 422 at 32) are said as such; one size says nothing yet.

A leak's trend is checked before the phase: a run that crept for an hour and died in evaluation
died of the creep; the phase is kept in the summary. Pure: the tests feed it scripted series.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from oomguard.supervisor.decide.memmodel import Fit
from oomguard.supervisor.decide.trend import MIB, Reading, Trend, steady_rise
from oomguard.supervisor.observe.phase import Phase, phase_of


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


@dataclass(frozen=True)
class Attribution:
    cause: Cause
    summary: str  # one line for the journal, status, report and dashboard
    figures: dict[str, Any] = field(default_factory=dict)  # what decided it

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause.value, "summary": self.summary, **self.figures}


def attribute(readings: Sequence[Reading], evidence: Evidence, micro_batch: int,
              what: str = "worker RSS", model: Fit | None = None,
              earlier: Sequence[tuple[int, int]] = ()) -> Attribution:
    """The cause of a memory failure at ``micro_batch``; ``what`` names the memory the readings are
    of; ``model`` is the memory model's line through this job's successful sizes, if it has one;
    ``earlier`` the (micro-batch, plateau bytes) of this run's earlier per-sample failures."""
    trend = steady_rise(readings)
    figures = _trend_figures(trend)
    phase = phase_of(evidence.frames, evidence.tail)
    if evidence.dataloader:
        line = evidence.dataloader.strip().rstrip(".")
        return Attribution(Cause.DATA_LOADER, f"a DataLoader worker died ({line})", {**figures, "evidence": line})
    if trend is not None and trend.steady():
        where = f"; it failed in {phase[0].value} ({phase[1]})" if phase else ""
        return Attribution(Cause.LEAK, f"leak: {trend.describe(what)} at micro-batch {micro_batch}{where}",
                           figures)
    if phase is not None:
        return Attribution(_PHASE_CAUSE[phase[0]], f"{phase[0].value}-time spike ({phase[1]})",
                           {**figures, "evidence": phase[1]})
    why = ("too few samples after warm-up to see a trend" if trend is None
           else f"no steady rise after warm-up (slope {trend.per_s / 1e6:.1f} MB/s, R² {trend.r2:.2f})")
    if readings:
        figures["plateau_bytes"] = max(r.used for r in readings)
        why += f", plateau {figures['plateau_bytes'] / MIB:.0f} MiB at micro-batch {micro_batch}"
    if model is not None and model.points >= 2:  # a line through two sizes or more: the scaling is measured
        figures["per_sample_bytes"] = round(model.per_sample_bytes)
        why += f"; the memory model measured {model.per_sample_bytes / MIB:.1f} MiB a sample"
        return Attribution(Cause.PER_SAMPLE, f"per-sample: {why}; memory follows the micro-batch", figures)
    return Attribution(Cause.PER_SAMPLE, _scaling(why, micro_batch, figures, earlier), figures)


def _scaling(why: str, micro_batch: int, figures: dict[str, Any], earlier: Sequence[tuple[int, int]]) -> str:
    """The per-sample summary, saying what the plateaus at each size show about the batch."""
    sizes = dict(earlier)
    if figures.get("plateau_bytes"):
        sizes[micro_batch] = figures["plateau_bytes"]
    if len(sizes) < 2:
        return f"per-sample, by elimination: {why}; only micro-batch {micro_batch} measured so far"
    ordered = sorted(sizes.items(), reverse=True)  # the largest first: the order halving goes
    figures["plateaus"] = {str(m): b for m, b in ordered}
    listed = ", ".join(f"{b / MIB:.0f} MiB at {m}" for m, b in ordered)
    largest, smallest = ordered[0][1], ordered[-1][1]
    figures["follows"] = largest > smallest * (1 + FOLLOW_MARGIN)
    if figures["follows"]:
        return f"per-sample: {why}; memory follows the micro-batch (plateaus {listed})"
    moved = "grew as the micro-batch shrank" if largest < smallest else "stayed level as the micro-batch shrank"
    return (f"by elimination (no leak, no phase): {why}; but memory does not follow the micro-batch: its "
            f"plateaus {moved} ({listed})")


def earlier_plateaus(attributions: Mapping[int, Mapping[str, Any]],
                     attempts: Sequence[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """(micro-batch, plateau) of each earlier attempt whose failure was attributed with a plateau,
    from the journal's ``attribution`` events and attempts; a later one at the same size wins."""
    micro = {a["attempt"]: a["micro_batch"] for a in attempts}
    return [(micro[n], int(data["plateau_bytes"])) for n, data in sorted(attributions.items())
            if data.get("plateau_bytes") and n in micro]


def _trend_figures(trend: Trend | None) -> dict[str, Any]:
    if trend is None:
        return {}
    return {"bytes_per_s": round(trend.per_s), "bytes_per_step": None if trend.per_step is None
            else round(trend.per_step), "r2": round(trend.r2, 3), "samples": trend.readings,
            "span_s": round(trend.span_s, 1), "steps": trend.steps}
