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
  today's remedy (halve) is right.

A leak's trend is checked before the phase: a run that crept for an hour and died in evaluation
died of the creep; the phase is kept in the summary. Pure: the tests feed it scripted series.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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
              what: str = "worker RSS", model: Fit | None = None) -> Attribution:
    """The cause of a memory failure at ``micro_batch``; ``what`` names the memory the readings are
    of; ``model`` is the memory model's line through this job's successful sizes, if it has one."""
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


def _trend_figures(trend: Trend | None) -> dict[str, Any]:
    if trend is None:
        return {}
    return {"bytes_per_s": round(trend.per_s), "bytes_per_step": None if trend.per_step is None
            else round(trend.per_step), "r2": round(trend.r2, 3), "samples": trend.readings,
            "span_s": round(trend.span_s, 1), "steps": trend.steps}
