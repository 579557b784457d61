"""A prediction beyond proof (``--predict-shrink``): from how far through the forward an OOM came,
the largest micro-batch a whole step is predicted to need no more than the budget.

``memmodel.unfit`` only skips sizes the evidence proves cannot fit; halving from there takes one
restart per halving. The probe also says what share of the failed attempt's forward had run
(``OomFigures.forward_fraction``) and what the process held before it (``fixed_bytes``: weights,
optimizer state). Memory past the fixed part follows the micro-batch and the forward's progress, and
the backward holds the forward's saved activations while it makes gradients of the same size, so

    need(m) ~= fixed + STEP * (held + requested - fixed) / fraction * m / failed_micro

When the forward had returned (the OOM came in the loss or the backward) the figures already hold
the forward's activations and part of the backward: they are scaled as they are (no ``STEP``), a
bound of the step rather than an extrapolation, so a backward OOM rarely goes below the halving.
This is no proof: memory need
not grow evenly through the forward (its share of leaf modules run is not its share of memory), and
a first step's optimizer state comes on top. So the
prediction is used only where it goes further down than the proven path would (fewer restarts
when the OOM came early at a size far too large), never below ``--min-micro-batch``; the next
attempt checks it (an OOM there is met by the proven path), and ``--grow`` climbs back toward the
largest size that fits when it went too far.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from oomguard.supervisor.decide.memmodel import OomFigures, Point, Prediction, budget, divisors, unfit
from oomguard.supervisor.decide.policy import Decision

STEP = 2.0  # a whole step's memory past the fixed part, in whole forwards (activations, then their gradients)


def per_sample(oom: OomFigures) -> float | None:
    """A whole step's bytes per sample past the fixed memory; None where the figures cannot tell
    (no fraction, a fraction outside (0, 1], no fixed memory measured, or nothing past it)."""
    fraction = oom.forward_fraction
    if fraction is None or not 0 < fraction <= 1 or oom.fixed_bytes <= 0:
        return None
    grown = oom.allocated_bytes + oom.requested_bytes - oom.fixed_bytes
    if grown <= 0 or oom.micro_batch < 1:
        return None
    whole = 1.0 if fraction == 1.0 else STEP  # a backward OOM's figures hold the forward and more
    return whole * grown / fraction / oom.micro_batch


def predict_after_oom(oom: OomFigures | None, proven: int, per_process_batch: int, margin: float,
                      min_micro: int, points: Sequence[Point] = ()) -> Prediction | None:
    """The largest divisor of the per-process batch predicted to fit under the OOM's limit, when it is
    below ``proven`` (the size the proven path would try); None when there is no such prediction."""
    slope = per_sample(oom) if oom is not None else None
    if oom is None or slope is None:
        return None
    # Under RLIMIT_AS most of the limit is address space mapped before the forward: the margin is of the room.
    room = budget(oom.limit_bytes, margin, oom.fixed_bytes if oom.address_space else 0.0)
    failed = [*points, Point(oom.micro_batch, None, False)]
    below = [d for d in reversed(divisors(per_process_batch)) if d < oom.micro_batch and unfit(d, failed) is None]
    fits = next((d for d in below if oom.fixed_bytes + slope * d <= room), None)
    floor = fits is None or fits < min_micro
    chosen = min_micro if floor else fits
    assert chosen is not None
    if chosen >= proven or per_process_batch % chosen:
        return None
    need = oom.fixed_bytes + slope * chosen
    where = ("after the forward had returned" if oom.forward_fraction == 1.0
             else f"{oom.forward_fraction:.0%} through the forward")
    told = (f"--min-micro-batch {min_micro} (nothing at or above it is predicted to fit)" if floor
            else f"micro-batch {chosen}, predicted to need {need:.3g} B")
    reason = (f"prediction beyond proof: at micro-batch {oom.micro_batch} the OOM came {where} holding "
              f"{oom.allocated_bytes} B (fixed {oom.fixed_bytes} B) and asking {oom.requested_bytes} B more: "
              f"{slope:.3g} B/sample for a whole step{'' if oom.forward_fraction == 1.0 else ' (twice the forward)'}, "
              f"so {told} under the budget {room:.3g} B "
              f"(the proven path would try {proven}; the next attempt checks it, --grow climbs back)")
    return Prediction(chosen, need, reason)


def jump(decision: Decision, failed_micro: int, prediction: Prediction | None) -> Decision:
    """The policy's decision after a memory failure at ``failed_micro``, taken further down to the
    predicted size when the decision shrinks the micro-batch (not a retry at the same size: a leak's,
    fragmentation's, a fallback's) and the prediction is smaller still; the reason says both."""
    if prediction is None or not decision.restart:
        return decision
    batch = decision.plan.batch
    if batch.micro_batch >= failed_micro or prediction.micro_batch >= batch.micro_batch:
        return decision
    if not batch.fits(prediction.micro_batch):
        return decision
    plan = replace(decision.plan, batch=batch.with_micro_batch(prediction.micro_batch))
    return replace(decision, plan=plan, reason=f"{decision.reason}; {prediction.reason}: {plan.batch.describe()}")
