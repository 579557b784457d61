"""What follows a failed attempt, as one pure function: ``recover``.

From the attempt's facts, the run's earlier failures, the memory knowledge (``SizeTuner``) and the
configuration to the ``Decision`` and the events to record, in order: whose fault, fragmentation,
the cause (``attribution``), what the memory model learns, the proven path (``policy.decide``) and,
under ``--predict-shrink``, the size the OOM's figures predict. No I/O and no clock: the loop
journals the notes and stores what was learned after the call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from oomguard.supervisor.decide.attribution import Attribution, Cause, Evidence, Limit, Plateau, attribute
from oomguard.supervisor.decide.classify import (
    Addition,
    FailureKind,
    Judgement,
    OwnCode,
    OwnFault,
    Verdict,
    at_oom,
    own_fault,
)
from oomguard.supervisor.decide.classify import seen as fatal
from oomguard.supervisor.decide.policy import Decision, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.observe.progress import AttemptWatch
from oomguard.supervisor.observe.sampler import MemorySample
from oomguard.supervisor.sizing.memmodel import (
    OomFigures,
    Point,
    SizeTuner,
    figures_at_oom,
    fit,
    jump,
    predict_after_oom,
)
from oomguard.supervisor.sizing.trend import Reading


@dataclass(frozen=True)
class Readings:
    """The attempt's memory series a failure's cause is judged on, and the limit the failure hit."""

    name: str
    series: tuple[Reading, ...] = ()
    limit: Limit | None = None


@dataclass(frozen=True)
class Facts:
    """What a failed attempt left, read before the call (``run/attempt.py``)."""

    attempt: int
    verdict: Verdict
    watch: AttemptWatch
    checkpoint: str | None = None  # the checkpoint it started from
    additions: frozenset[Addition] = frozenset()  # oomguard's own code in the worker
    handover_lost: str | None = None  # the spare it was handed to had exited already: why
    own_code: OwnCode = OwnCode(())
    sample: MemorySample | None = None  # the newest memory sample
    evidence: Evidence | None = None  # a memory failure's evidence (with the journal's step peaks)
    readings: Readings | None = None  # a memory failure's series and limit
    earlier: tuple[Plateau, ...] = ()  # this run's earlier plateaus (the journal's attributions)


@dataclass(frozen=True)
class RecoveryConfig:
    policy: PolicyConfig = PolicyConfig()
    predict_shrink: bool = False


@dataclass(frozen=True)
class Note:
    """One thing to record: a journal event (``name`` with ``data``) and/or a line to say."""

    name: str | None
    data: Mapping[str, Any] = field(default_factory=dict)
    say: str | None = None


@dataclass(frozen=True)
class Recovery:
    """The decision (this node's: node 0's may replace it) and what the loop records and keeps."""

    decision: Decision
    failure: Failure
    attribution: Attribution | None
    memory: SizeTuner  # the knowledge with what this failure taught (no fit store: the loop writes that)
    point: Point | None  # the point to add to the fit store
    leak_per_s: float | None  # a leak's measured rate, for the next attempt's forecast
    notes: tuple[Note, ...]


def recover(facts: Facts, history: Sequence[Failure], plan: Plan, memory: SizeTuner,
            config: RecoveryConfig) -> Recovery:
    """What to do after the failed attempt ``facts`` tells of, given the earlier failures (oldest first)."""
    kind = facts.verdict.kind
    assert kind is not None
    memory = replace(memory, store=None, points=[*memory.points])  # learned here, stored by the loop
    notes: list[Note] = []
    # Our own code failed it (decide/ownfault.py): nothing it shows is the script's, nor its memory's.
    own = own_fault(kind, facts.watch.scanner, facts.additions, facts.own_code, facts.handover_lost)
    judgement = _fragmentation(facts, plan, memory, notes)
    attribution = _attribution(facts, plan, memory, notes) if own is None else None
    failure = _failure(facts, plan, judgement, attribution, own)
    fits = own is None and (attribution is None or attribution.cause.fits_model)  # leaks, spikes stay out
    point = None
    if fits:
        watch = facts.watch
        memory.record(failure.micro_batch, memory.peak_bytes(watch.peak, facts.sample, watch.allocator),
                      memory_failed=kind.is_memory)
        point = memory.points[-1]
    oom = _figures_at_oom(facts, plan, memory, config.predict_shrink) if own is None else None
    hint = _hint(facts, failure, memory, oom, notes) if kind.is_memory and fits else None
    decision = decide(failure, history, plan, config.policy, fit_hint=hint)
    if config.predict_shrink and kind.is_memory and fits:
        decision = _predicted(decision, failure.micro_batch, plan, memory, oom, config, notes)
    rate = attribution.figures.get("bytes_per_s") if attribution and attribution.cause is Cause.LEAK else None
    return Recovery(decision, failure, attribution, memory, point, float(rate) if rate else None, tuple(notes))


def decision_event(decision: Decision, failure: Failure) -> dict[str, Any]:
    """The ``decision`` event's data: the decision carried out (node 0's, with several nodes)."""
    return {"action": decision.action.value, "reason": decision.reason,
            "micro_batch": decision.plan.batch.micro_batch, "grad_accum": decision.plan.batch.grad_accum,
            "kind": failure.kind.value, "evidence": failure.evidence,
            "cause": failure.attribution.cause.value if failure.attribution else None}


def _fragmentation(facts: Facts, plan: Plan, memory: SizeTuner, notes: list[Note]) -> Judgement:
    """Was a CUDA OOM fragmentation: judged on the allocator's figures before this attempt's point."""
    watch, scan = facts.watch, facts.watch.scanner
    judgement = at_oom(watch.allocator.oom, scan.tried_bytes, scan.reserved_unallocated, scan.capacity_bytes,
                       memory.predicted_gpu_peak(plan.batch.micro_batch, facts.sample))
    if facts.verdict.kind is FailureKind.CUDA_OOM and (scan.tried_bytes is not None or watch.allocator.oom is not None):
        notes.append(Note("fragmentation", {"fragmented": judgement.fragmented, "why": judgement.why}))
    return judgement


def _attribution(facts: Facts, plan: Plan, memory: SizeTuner, notes: list[Note]) -> Attribution | None:
    """The cause of a memory failure, journaled with the figures that decided it."""
    if facts.evidence is None or facts.readings is None:
        return None  # not a memory failure
    readings = facts.readings
    attribution = attribute(list(readings.series), facts.evidence, plan.batch.micro_batch, readings.name,
                            fit(memory.points), readings.limit, facts.earlier, failed=True)
    notes.append(Note("attribution", attribution.as_dict(), f"cause: {attribution.summary}"))
    return attribution


def _failure(facts: Facts, plan: Plan, judgement: Judgement, attribution: Attribution | None,
             own: OwnFault | None) -> Failure:
    """The failure as the policy sees it: kind, size, fragmentation and cause (none where ``own``)."""
    verdict, watch = facts.verdict, facts.watch
    assert verdict.kind is not None
    scan = watch.scanner
    load_error = facts.checkpoint is not None and scan.load_error is not None and not watch.progressed
    return Failure(facts.attempt, verdict.kind, plan.batch.micro_batch, verdict.evidence, judgement.fragmented,
                   watch.new_checkpoint, facts.checkpoint, load_error, attribution,
                   fatal(scan, verdict.exit_code, watch.progressed), own)


def _figures_at_oom(facts: Facts, plan: Plan, memory: SizeTuner, predict_shrink: bool) -> OomFigures | None:
    """The probe's figures at a memory failure (a CUDA OOM's allocator, a host OOM's address space
    under RLIMIT_AS), which the memory model also learns the fixed memory and the limit from."""
    kind, allocator = facts.verdict.kind, facts.watch.allocator
    if kind not in (FailureKind.CUDA_OOM, FailureKind.HOST_OOM):
        return None
    cuda = allocator.oom if kind is FailureKind.CUDA_OOM else None
    progress = allocator.progress
    if progress is not None and (progress.memory == "cuda_allocated") != (kind is FailureKind.CUDA_OOM):
        progress = None  # a record of the other device's OOM (one the script caught): not this failure's
    oom = figures_at_oom(cuda, plan.batch.micro_batch, progress)
    if oom is not None and (predict_shrink or not oom.address_space):
        memory.learn(oom)  # the address-space model serves the prediction and the growth after it only
    return oom


def _hint(facts: Facts, failure: Failure, memory: SizeTuner, oom: OomFigures | None,
          notes: list[Note]) -> int | None:
    """The memory model's largest size predicted to fit after the OOM, if it has one."""
    # Address space under RLIMIT_AS proves nothing: threads' stacks and malloc arenas mapped after the
    # first forward are counted as if they followed the batch. Only the prediction may use it.
    proof = oom if oom is not None and not oom.address_space else None
    hint = memory.shrink_hint(failure.micro_batch, facts.sample, proof)
    if hint is None:
        return None
    notes.append(Note("memory_model", {"micro_batch": hint.micro_batch, "predicted_bytes": hint.predicted_peak,
                                       "why": hint.reason}))
    return hint.micro_batch


def _predicted(decision: Decision, failed_micro: int, plan: Plan, memory: SizeTuner, oom: OomFigures | None,
               config: RecoveryConfig, notes: list[Note]) -> Decision:
    """--predict-shrink: the decision taken down to the size the OOM's figures predict, when below the proven path's."""
    prediction = predict_after_oom(oom, decision.plan.batch.micro_batch, plan.batch.per_process_batch,
                                            memory.margin, config.policy.min_micro_batch,
                                            [*memory.stored_failures, *memory.points])
    jumped = jump(decision, failed_micro, prediction)
    if jumped is not decision and prediction is not None:
        notes.append(Note("memory_prediction", {
            "micro_batch": prediction.micro_batch, "from_micro_batch": failed_micro,
            "proven_micro_batch": decision.plan.batch.micro_batch, "predicted_bytes": prediction.predicted_peak,
            "why": prediction.reason}, f"--predict-shrink: {prediction.reason}"))
    return jumped
