"""The memory model: fitting, shrinking after an OOM, growing, the issue's 96/40 scenario; and the size
tuner's bookkeeping (the points a restarted supervisor rebuilds, which peak and capacity count, what a
failing fit store costs) and the prediction beyond proof."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from oomguard.common.batch import BatchPlan
from oomguard.probe.forward import ForwardTracker
from oomguard.supervisor.config import build_config
from oomguard.supervisor.decide import policy
from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.observe.allocator import AllocatorOom, AllocatorReport, OomProgress
from oomguard.supervisor.observe.checkpoints import CheckpointIndex
from oomguard.supervisor.observe.gpu import GpuReading
from oomguard.supervisor.observe.sampler import AttemptPeak, MemorySample
from oomguard.supervisor.record.fitstore import OUTPUT, FitRecord, FitStore, JobKey, ModelPrint
from oomguard.supervisor.sizing import memmodel as extrapolate
from oomguard.supervisor.sizing.memmodel import (
    Fit,
    OomFigures,
    Point,
    Prediction,
    SizeTuner,
    budget,
    divisors,
    figures_at_oom,
    fit,
    propose_growth,
    shrink_after_oom,
    unfit,
)

CAPACITY = 100_000  # bytes of a pretend device; the model is unit-free


def test_divisors() -> None:
    assert divisors(96) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    assert divisors(1) == [1] and divisors(49) == [1, 7, 49]


def test_one_point_assumes_no_fixed_memory() -> None:
    model = fit([Point(24, 48_000, True), Point(48, 100_000, False)])
    assert model is not None and model.fixed_bytes == 0 and model.per_sample_bytes == 2_000
    assert model.predict(32) == 64_000


def test_two_points_fit_the_line_and_keep_the_worst_peak() -> None:
    model = fit([Point(8, 20_000, True), Point(16, 30_000, True), Point(16, 29_000, True)])
    assert model is not None and model.points == 2
    assert model.fixed_bytes == pytest.approx(10_000) and model.per_sample_bytes == pytest.approx(1_250)


def test_noisy_points_never_under_predict() -> None:
    points = [Point(8, 21_000, True), Point(12, 24_000, True), Point(16, 29_500, True)]
    model = fit(points)
    assert model is not None
    assert all(model.predict(p.micro_batch) >= (p.peak_bytes or 0) - 1e-6 for p in points)


def test_negative_intercept_falls_back_to_no_fixed_memory() -> None:
    model = fit([Point(8, 8_000, True), Point(16, 40_000, True)])
    assert model is not None and model.fixed_bytes == 0 and model.per_sample_bytes == 2_500


def test_no_success_means_no_model() -> None:
    assert fit([Point(96, 100_000, False)]) is None and fit([Point(8, None, True)]) is None


def test_shrink_without_successes_halves() -> None:
    pick = shrink_after_oom([], 96, 96, CAPACITY)
    assert pick is not None and pick.micro_batch == 48 and pick.predicted_peak is None


def test_shrink_with_one_success_stays_at_half() -> None:
    # 12 ran at 24 % of capacity: alone that predicts 32 fits, but one point cannot justify > 96/2.
    points = [Point(12, 24_000, True), Point(96, CAPACITY, False)]
    pick = shrink_after_oom(points, 96, 96, CAPACITY)
    assert pick is not None and pick.micro_batch == 32  # 48 predicted 96 000 > 90 000
    assert "from one size" in pick.reason


def test_shrink_with_two_successes_may_skip_above_half() -> None:
    points = [Point(4, 14_000, True), Point(8, 18_000, True)]  # 10 000 + 1 000 / sample
    pick = shrink_after_oom([*points, Point(96, CAPACITY, False)], 96, 96, CAPACITY)
    assert pick is not None and pick.micro_batch == 48 and pick.predicted_peak == pytest.approx(58_000)
    pick = shrink_after_oom([*points, Point(64, CAPACITY, False)], 64, 128, CAPACITY)
    assert pick is not None and pick.micro_batch == 32  # above 64/2 is fine, at or above 64 never


def test_shrink_jumps_below_half_when_half_cannot_fit() -> None:
    points = [Point(24, 60_000, True), Point(32, 78_000, True)]  # 6 000 + 2 250 / sample
    pick = shrink_after_oom([*points, Point(48, CAPACITY, False)], 48, 96, CAPACITY)
    assert pick is not None and pick.micro_batch == 32


def test_shrink_never_picks_a_size_that_failed() -> None:
    points = [Point(2, 4_000, True), Point(4, 6_000, True), Point(24, CAPACITY, False)]
    pick = shrink_after_oom(points, 48, 96, CAPACITY)
    assert pick is not None and pick.micro_batch < 24


def test_shrink_at_the_floor_is_none() -> None:
    assert shrink_after_oom([], 8, 96, CAPACITY, min_micro=8) is None
    assert shrink_after_oom([], 1, 96, CAPACITY) is None


def test_growth_needs_a_model_and_room() -> None:
    assert propose_growth([], 24, 96, CAPACITY) is None
    assert propose_growth([Point(24, 80_000, True)], 24, 96, CAPACITY) is None
    grow = propose_growth([Point(24, 48_000, True), Point(48, CAPACITY, False)], 24, 96, CAPACITY)
    assert grow is not None and grow.micro_batch == 32  # 48 failed once: never again
    doubling = propose_growth(
        [Point(24, 48_000, True), Point(48, CAPACITY, False)], 24, 96, CAPACITY, min_factor=2
    )
    assert doubling is None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="margin"):
        shrink_after_oom([], 8, 96, CAPACITY, margin=1.0)
    with pytest.raises(ValueError, match="micro_batch"):
        Point(0, None, True)


# --- the scenario -----------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    final: int
    failures: int
    tried: tuple[int, ...]


def simulate(peak: Callable[[int], int], start: int, batch: int, use_model: bool, grow: bool) -> Outcome:
    """Drive the model as the supervisor would: run, OOM or succeed, shrink, optionally grow."""
    micro, points, tried = start, [], []
    for _ in range(20):
        tried.append(micro)
        if peak(micro) > CAPACITY:
            points.append(Point(micro, CAPACITY, False))  # at an OOM the device is full
            pick = shrink_after_oom(points, micro, batch, CAPACITY) if use_model else halve(micro, batch)
            assert pick is not None
            micro = pick if isinstance(pick, int) else pick.micro_batch
            continue
        points.append(Point(micro, peak(micro), True))
        grown = propose_growth(points, micro, batch, CAPACITY) if grow else None
        if grown is None:
            break
        micro = grown.micro_batch
    return Outcome(micro, sum(not p.succeeded for p in points), tuple(tried))


def halve(failed: int, batch: int) -> int:
    return max(d for d in divisors(batch) if d <= failed // 2)


def linear(fixed: int, per_sample: int) -> Callable[[int], int]:
    return lambda micro: fixed + per_sample * micro


def test_scenario_96_where_40_fits() -> None:
    peak = linear(8_000, 2_300)  # 40 -> 100 000 fits exactly, 41 -> 102 300 does not
    assert peak(40) <= CAPACITY < peak(41)
    halving = simulate(peak, 96, 96, use_model=False, grow=False)
    assert halving == Outcome(24, 2, (96, 48, 24))
    model = simulate(peak, 96, 96, use_model=True, grow=True)
    assert model.final == 32 and model.failures <= halving.failures
    assert model.tried == (96, 48, 24, 32)


def test_model_never_does_worse_than_halving_on_linear_curves() -> None:
    # Any curve with non-negative fixed memory: one-point predictions over-estimate, so growth and
    # shrinking never add a failure, and the run never ends below where halving ends.
    for batch, fixed_pct, largest_fit in itertools.product(
        (64, 96, 128, 120), (0, 5, 20, 40), range(2, 120, 7)
    ):
        fixed = CAPACITY * fixed_pct // 100
        per_sample = (CAPACITY - fixed) // largest_fit
        peak = linear(fixed, per_sample)
        if peak(1) > CAPACITY or largest_fit >= batch:
            continue
        halving = simulate(peak, batch, batch, use_model=False, grow=False)
        model = simulate(peak, batch, batch, use_model=True, grow=True)
        assert model.failures <= halving.failures, (batch, fixed_pct, largest_fit)
        assert halving.final <= model.final <= largest_fit, (batch, fixed_pct, largest_fit)


# --- merged from tests/test_memmodel_pins.py ----------------------------------------------------------------
# The memory model's proposals with their reasons, at their boundaries (docs/mutation.md: the
# survivors these pin): each Prediction is compared whole, size, predicted peak and reason.


GIB = 2**30
TWO_SIZES = [Point(8, 6 * GIB, True), Point(16, 10 * GIB, True)]  # 2 GiB fixed + 0.5 GiB a sample


def test_shrinking_without_a_success_takes_the_largest_divisor_at_half() -> None:
    assert shrink_after_oom([], 64, 64, 80 * GIB, 0.1, 1) == Prediction(
        32, None, "no successful attempt yet: largest divisor <= 64/2")


def test_one_size_caps_the_shrink_at_half_and_fits_at_exactly_the_budget() -> None:
    """8 GiB at 8: 1 GiB a sample; 32 needs 32 GiB, exactly the 32 GiB budget (no margin)."""
    assert shrink_after_oom([Point(8, 8 * GIB, True)], 64, 64, 32 * GIB, 0.0, 1) == Prediction(
        32, 32 * GIB, "model: 1.07e+09 B/sample from one size, no fixed memory assumed; budget 3.44e+10 B, "
        "at most 64/2")


def test_two_sizes_name_the_line_and_nothing_that_fits_tries_the_smallest() -> None:
    assert shrink_after_oom(TWO_SIZES, 64, 64, 80 * GIB, 0.1, 1) == Prediction(
        32, 18 * GIB, "model: fixed 2.15e+09 B + 5.37e+08 B/sample from 2 sizes; budget 7.73e+10 B")
    heavy = [Point(8, 70 * GIB, True), Point(16, 75 * GIB, True)]  # 65 GiB fixed
    assert shrink_after_oom(heavy, 32, 64, 64 * GIB, 0.1, 2) == Prediction(
        2, 66.25 * GIB, "model predicts nothing fits under 6.18e+10 B; trying the smallest")


def test_growth_fits_at_exactly_the_budget_and_names_the_line() -> None:
    assert propose_growth([Point(8, 8 * GIB, True)], 8, 64, 64 * GIB, 0.0) == Prediction(
        64, 64 * GIB, "model: 1.07e+09 B/sample from one size, no fixed memory assumed; budget 6.87e+10 B")
    assert propose_growth(TWO_SIZES, 16, 64, 80 * GIB, 0.1) == Prediction(
        64, 34 * GIB, "model: fixed 2.15e+09 B + 5.37e+08 B/sample from 2 sizes; budget 7.73e+10 B")


def test_growth_stays_below_every_size_that_failed() -> None:
    """A failure at 16 with a per-process batch of 30: 15 is the largest divisor below it."""
    grown = propose_growth([Point(5, 5 * GIB, True), Point(16, None, False)], 5, 30, 80 * GIB, 0.1)
    assert grown is not None and grown.micro_batch == 15
    capped = propose_growth([Point(8, 6 * GIB, True), Point(32, None, False)], 8, 64, 80 * GIB, 0.1)
    assert capped is not None and capped.micro_batch == 16


def test_the_smallest_batch_and_capacity_are_valid_zero_is_refused() -> None:
    assert propose_growth([Point(1, GIB, True)], 1, 1, 1, 0.0) is None  # nothing larger than 1 to grow to
    with pytest.raises(ValueError, match="^per-process batch must be >= 1, got 0$"):
        propose_growth(TWO_SIZES, 16, 0, 80 * GIB)
    with pytest.raises(ValueError, match="^capacity must be positive, got 0$"):
        propose_growth(TWO_SIZES, 16, 64, 0)


def test_a_line_that_falls_between_two_sizes_is_replaced_by_the_safe_line_of_both() -> None:
    """Noise between close sizes (10 GiB at 8, 9 GiB at 16): no fixed memory, the larger share per
    sample (1.25 GiB at 8), still a line through two sizes, so no cap at half the failed size."""
    noisy = [Point(8, 10 * GIB, True), Point(16, 9 * GIB, True)]
    assert shrink_after_oom(noisy, 64, 64, 80 * GIB, 0.1, 1) == Prediction(
        32, 40 * GIB, "model: fixed 0 B + 1.34e+09 B/sample from 2 sizes; budget 7.73e+10 B")


def test_growth_takes_the_next_divisor_up() -> None:
    """From 8 with a per-process batch of 72, only 9 fits (1 GiB a sample, 9.5 GiB of budget)."""
    assert propose_growth([Point(8, 8 * GIB, True)], 8, 72, 10 * GIB, 0.05) == Prediction(
        9, 9 * GIB, "model: 1.07e+09 B/sample from one size, no fixed memory assumed; budget 1.02e+10 B")


# --predict-shrink's changes: a measured fixed memory and, under RLIMIT_AS, a floor the margin leaves alone.

def test_the_budget_takes_the_margin_of_the_room_above_the_floor() -> None:
    assert budget(100, 0.5) == 50  # no floor: the capacity less its margin
    assert budget(100, 0.5, 60) == 80


def test_a_measured_fixed_memory_counts_only_below_the_smallest_peak() -> None:
    one = [Point(4, 100, True)]
    assert fit(one, 1) == Fit(1, 24.75, 1)  # a byte is a measurement
    assert fit(one, 100) == Fit(0.0, 25.0, 1)  # all of the peak: no per-sample memory left, so not believed
    assert fit(one, 150) == Fit(0.0, 25.0, 1)
    # A falling line is replaced by the safe line through the fixed memory: (10 - 2) GiB over 8 at most.
    assert fit([Point(8, 10 * GIB, True), Point(16, 9 * GIB, True)], 2 * GIB) == Fit(2 * GIB, GIB, 2)


def test_the_shrink_uses_the_fixed_memory_and_names_it() -> None:
    # 10 GiB at 8 with 6 GiB fixed: 0.5 GiB a sample, so 32 (22 GiB) fits the 32 GiB; without it 16.
    # The reason says the probe measured it, not when: the tuner takes what the worker held before
    # its first forward, or after its first optimizer step once the probe read that.
    one = [Point(8, 10 * GIB, True)]
    assert shrink_after_oom(one, 64, 64, 32 * GIB, 0.0, 1, fixed_bytes=6 * GIB) == Prediction(
        32, 22 * GIB, "model: 5.37e+08 B/sample from one size, fixed 6.44e+09 B measured by the probe; "
        "budget 3.44e+10 B, at most 64/2")
    assert shrink_after_oom(one, 64, 64, 32 * GIB, 0.0, 1).micro_batch == 16  # type: ignore[union-attr]


def test_under_a_floor_the_shrink_and_the_growth_keep_the_margin_off_it() -> None:
    # 40 GiB with 6 GiB mapped below the forward: half the room above it is 23 GiB, enough for 32
    # (22 GiB); half of the whole 40 GiB (20 GiB) is not.
    one = [Point(8, 10 * GIB, True)]
    with_floor = shrink_after_oom(one, 64, 64, 40 * GIB, 0.5, 1, fixed_bytes=6 * GIB, floor=6 * GIB)
    assert with_floor is not None and with_floor.micro_batch == 32 and "budget 2.47e+10 B" in with_floor.reason
    assert shrink_after_oom(one, 64, 64, 40 * GIB, 0.5, 1, fixed_bytes=6 * GIB).micro_batch == 16  # type: ignore[union-attr]
    grow = propose_growth(one, 8, 64, 40 * GIB, 0.5, fixed_bytes=6 * GIB, floor=6 * GIB)
    assert grow is not None and grow.micro_batch == 32
    assert propose_growth(one, 8, 64, 40 * GIB, 0.5, fixed_bytes=6 * GIB).micro_batch == 16  # type: ignore[union-attr]


def test_a_bound_exactly_at_the_limit_proves_nothing() -> None:
    # 64 GiB held and asked at 64 scale to exactly the 32 GiB limit at 32: it may still fit.
    oom = OomFigures(64, 32 * GIB, 32 * GIB, 32 * GIB)
    assert oom.need_at(32) == 32 * GIB and not oom.proves_unfit(32) and unfit(32, [], oom) is None
    assert oom.proves_unfit(33)


def test_the_safe_line_replaces_a_fit_only_past_its_edges() -> None:
    # A line through the origin is believed, even with a measured fixed memory below it: it is the
    # larger prediction (32 GiB at 32, where the safe line through 1 GiB says 28.1 GiB).
    assert fit([Point(8, 8 * GIB, True), Point(16, 16 * GIB, True)], GIB) == Fit(0.0, GIB, 2)
    # A flat line is not (it would predict that any size fits): the safe line through 0 instead.
    assert fit([Point(8, 10 * GIB, True), Point(16, 10 * GIB, True)]) == Fit(0.0, 10 * GIB / 8, 2)
    # One byte a sample is a rise.
    assert fit([Point(8, 10 * GIB, True), Point(16, 10 * GIB + 8, True)]) == Fit(10 * GIB - 8, 1.0, 2)


# --- merged from tests/unit/supervisor/sizing/test_tuning.py ---------------------------------------------

KEY = JobKey(("python", "train.py"), (), 1)


def sample(*gpu_totals: int, host: int = 64 * GIB) -> MemorySample:
    gpus = tuple(GpuReading(i, i, f"GPU-{i}", "H100", total, 0, total, 0, None, ())
                 for i, total in enumerate(gpu_totals))
    return MemorySample(0.0, 0.0, 1, GIB, (1,), host, host // 2, None, None, gpus)


def row(kind: str, micro: int, ended: float | None = 1.0, **peaks: int | None) -> dict[str, Any]:
    return {"kind": kind, "micro_batch": micro, "ended": ended,
            **{"peak_gpu": None, "peak_rss": None, **peaks}}


def test_the_journal_gives_back_each_attempts_point() -> None:
    rows = [row("cuda_oom", 64), row("host_oom", 48), row("memory_limit", 40),
            row("crash", 32, peak_allocated=9 * GIB, peak_gpu=11 * GIB, peak_rss=2 * GIB),
            row("crash", 24, peak_gpu=8 * GIB, peak_rss=2 * GIB), row("crash", 16, peak_rss=2 * GIB),
            row("crash", 12), row("crash", 8, ended=None, peak_rss=GIB)]
    assert SizeTuner.points_from_attempts(rows) == [
        Point(64, None, False), Point(48, None, False), Point(40, None, False),
        Point(32, 9 * GIB, True), Point(24, 8 * GIB, True), Point(16, 2 * GIB, True)]


def test_the_peak_that_counts_probe_then_gpu_then_rss() -> None:
    tuner = SizeTuner(64, 1, 0.1)
    peak = AttemptPeak(worker_rss_bytes=2 * GIB, worker_gpu_bytes=9 * GIB)
    assert tuner.peak_bytes(peak, None, AllocatorReport(allocated_peak=0)) == 2 * GIB  # no probe peak: RSS
    assert tuner.allocator_limit is None
    assert tuner.peak_bytes(peak, sample()) == 2 * GIB  # no GPU in the sample: RSS
    assert tuner.peak_bytes(peak, sample(80 * GIB)) == 9 * GIB
    assert tuner.peak_bytes(AttemptPeak(worker_rss_bytes=0), None) is None
    assert tuner.peak_bytes(None, sample(80 * GIB)) is None


def test_the_capacity_without_a_gpu_or_limit_is_the_host() -> None:
    assert SizeTuner(64, 1, 0.1).capacity(sample(host=64 * GIB)) == 64 * GIB
    assert SizeTuner(64, 1, 0.1, memory_limit=8 * GIB).capacity(sample(host=64 * GIB)) == 8 * GIB
    assert SizeTuner(64, 1, 0.1).capacity(sample(80 * GIB, 40 * GIB)) == 40 * GIB


def test_growth_and_shrinking_measure_against_the_samples_device() -> None:
    """One success at 8 using 4 GiB (0.5 GiB a sample) on a 40 GiB device with a 10 % margin: 64
    needs 32 GiB, under the 36 GiB budget. Without the sample the host's 8 GiB limit would forbid it."""
    tuner = SizeTuner(64, 1, 0.1, memory_limit=8 * GIB)
    grown = tuner.growth(8, 4 * GIB, sample(40 * GIB))
    assert grown is not None and grown.micro_batch == 64
    assert tuner.growth(8, None, sample(40 * GIB)) is None
    tuner.record(8, 4 * GIB, memory_failed=False)
    assert tuner.growth(8, None, sample(40 * GIB)) is None  # no peak of the running attempt: no growth yet
    tuner.points.clear()
    full = SizeTuner(64, 1, 0.5, memory_limit=8 * GIB)  # half the device kept free: 20 GiB, so 32 at most
    grown = full.growth(8, 4 * GIB, sample(40 * GIB))
    assert grown is not None and grown.micro_batch == 32
    tuner.record(32, 16 * GIB, memory_failed=False)
    hint = tuner.shrink_hint(64, sample(40 * GIB))
    assert hint is not None and hint.micro_batch == 32  # at 8 GiB (the host) it would be 8 at most
    assert SizeTuner(64, 1, 0.1).shrink_hint(64, None, None) is None


class BrokenStore:
    def __init__(self) -> None:
        self.calls = 0

    def record(self, key: JobKey, point: Point, models: object = ()) -> None:
        self.calls += 1
        raise OSError("disk full")


def test_a_record_is_a_success_with_its_peak_or_a_failure_without_one() -> None:
    tuner = SizeTuner(64, 1, 0.1)
    tuner.record(32, 9 * GIB, memory_failed=True)
    tuner.record(16, 5 * GIB, memory_failed=False)
    assert tuner.points == [Point(32, None, False), Point(16, 5 * GIB, True)]


def test_a_failing_fit_store_is_dropped_and_the_run_goes_on() -> None:
    store = BrokenStore()
    tuner = SizeTuner(64, 1, 0.1, store=store, key=KEY)  # type: ignore[arg-type]
    tuner.record(32, 9 * GIB, memory_failed=False)
    assert tuner.store is None and store.calls == 1
    tuner.record(16, 5 * GIB, memory_failed=False)
    assert store.calls == 1 and len(tuner.points) == 2
    keyless = SizeTuner(64, 1, 0.1, store=BrokenStore())  # type: ignore[arg-type]
    keyless.record(8, GIB, memory_failed=False)  # no key yet: nothing is stored
    assert keyless.store is not None and keyless.store.calls == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize(("limit", "gpus", "predicted"), [
    (None, (), None),  # host memory: the model is no GPU peak
    (None, (80 * GIB,), 40 * GIB),
    (72 * GIB, (), 40 * GIB),  # the probe's limit says the model is of a GPU
])
def test_the_gpu_peak_is_predicted_only_where_the_model_is_of_a_gpu(
        limit: int | None, gpus: tuple[int, ...], predicted: float | None) -> None:
    tuner = SizeTuner(64, 1, 0.1, allocator_limit=limit)
    tuner.record(8, 8 * GIB, memory_failed=False)
    tuner.record(16, 12 * GIB, memory_failed=False)  # 4 GiB fixed + 0.5 GiB a sample
    assert tuner.predicted_gpu_peak(72, sample(*gpus)) == predicted
    assert SizeTuner(64, 1, 0.1, allocator_limit=limit).predicted_gpu_peak(72, sample(*gpus)) is None


def test_the_probes_figures_at_an_oom_need_the_allocation_and_name_its_own_micro_batch() -> None:
    assert figures_at_oom(AllocatorOom("cuda:0", GIB, None, None, None, 80 * GIB), 64) is None
    own = figures_at_oom(AllocatorOom("cuda:0", GIB, 70 * GIB, 74 * GIB, None, 80 * GIB, micro_batch=32), 64)
    assert own is not None and own.micro_batch == 32


# --predict-shrink's bookkeeping: the fixed memory and the address-space floor the tuner learns.

def test_the_probes_progress_at_an_oom_gives_its_figures_and_its_own_micro_batch() -> None:
    progress = OomProgress("address_space", None, 20, 160, 180, None, 0.5)
    assert figures_at_oom(None, 8, progress) == OomFigures(8, 20, 160, 180, 0, 0.5, True)
    named = OomProgress("cuda_allocated", 16, 20, 160, 180, 100, 1.0)
    assert figures_at_oom(None, 8, named) == OomFigures(16, 20, 160, 180, 100, 1.0, False)


def test_what_a_gpu_worker_held_after_its_first_step_becomes_the_fixed_memory() -> None:
    tuner = SizeTuner(64, 1, 0.1)
    report = AllocatorReport()
    report.take({"type": "step", "step": 1, "devices": {"0": {"allocated_peak": 10 * GIB, "limit_bytes": 80 * GIB}},
                 "held_after_first_step": {"cuda_allocated": 10 * GIB}})
    assert tuner.peak_bytes(None, None, report) == 10 * GIB and tuner.fixed_bytes == 0  # all of the peak: not fixed
    report.take({"type": "step", "step": 2, "devices": {"0": {"allocated_peak": 12 * GIB, "limit_bytes": 80 * GIB}},
                 "held_after_first_step": {"cuda_allocated": 4 * GIB}})
    assert tuner.peak_bytes(None, None, report) == 12 * GIB and tuner.fixed_bytes == 10 * GIB
    assert not tuner.address_space and tuner.allocator_limit == 80 * GIB


def test_an_address_space_step_makes_the_tuner_count_address_space() -> None:
    tuner = SizeTuner(64, 1, 0.1)
    report = AllocatorReport()
    report.take({"type": "step", "step": 1, "vm_limit_bytes": 40 * GIB, "vm_peak_bytes": 10 * GIB, "devices": {}})
    assert tuner.peak_bytes(None, None, report) == 10 * GIB
    assert (tuner.address_space, tuner.allocator_limit) == (True, 40 * GIB)


def test_the_shrink_hint_passes_the_fixed_memory_and_the_floor() -> None:
    # 10 GiB at 8 with 6 GiB fixed under a 40 GiB address-space limit: half the room above the 6 GiB
    # is 23 GiB, enough for 32 (22 GiB); without the floor 20 GiB, without the fixed memory 1.25 GiB a sample.
    tuner = SizeTuner(64, 1, 0.5, points=[Point(8, 10 * GIB, True)], allocator_limit=40 * GIB,
                      fixed_bytes=6 * GIB, address_space=True)
    hint = tuner.shrink_hint(64, None)
    assert hint is not None and hint.micro_batch == 32
    tuner.address_space = False  # the same figures of allocated memory: the margin is of all of it
    assert tuner.shrink_hint(64, None).micro_batch == 16  # type: ignore[union-attr]


class OtherModelsStore:
    """A record measured with another model, in a store that then fails to write."""

    def load(self, key: JobKey) -> FitRecord:
        return FitRecord("fp", "job", 8, 16, (Point(8, GIB, True), Point(16, None, False)), 0.0,
                         (ModelPrint("a" * 16, 100, 2),))

    def rewrite(self, key: JobKey, points: object, models: object) -> None:
        raise OSError("disk full")


def test_another_model_is_said_even_where_the_store_cannot_be_rewritten() -> None:
    tuner = SizeTuner(16, 1, 0.1, store=OtherModelsStore(), key=KEY)  # type: ignore[arg-type]
    assert tuner.starting_micro(16) == 8
    change = tuner.model_seen(ModelPrint("b" * 16, 200, 2), 8)
    assert change is not None and change.restart_at == 16 and (change.then.params, change.now.params) == (100, 200)
    assert tuner.store is None and tuner.stored_failures == [] and tuner.models == (ModelPrint("b" * 16, 200, 2),)


class StagesStore:
    """A record measured with two models, as a pipeline's ranks train two stages; rewrites kept."""

    def __init__(self) -> None:
        self.rewrites: list[tuple[object, object]] = []

    def load(self, key: JobKey) -> FitRecord:
        return FitRecord("fp", "job", 8, 16, (Point(8, GIB, True), Point(16, None, False)), 0.0,
                         (ModelPrint("c" * 16, 900, 4), ModelPrint("a" * 16, 100, 2)))

    def rewrite(self, key: JobKey, points: object, models: object) -> None:
        self.rewrites.append((points, models))


def test_a_change_from_a_record_of_several_models_names_the_largest() -> None:
    """The reason quotes one of the record's models: the one with the most parameters (the stage the
    user sees as "the model"), whichever digest sorts first."""
    tuner = SizeTuner(16, 1, 0.1, store=StagesStore(), key=KEY)  # type: ignore[arg-type]
    assert tuner.starting_micro(16) == 8
    change = tuner.model_seen(ModelPrint("b" * 16, 500, 3), 8)
    assert change is not None and (change.then.params, change.now.params, change.restart_at) == (900, 500, 16)
    assert "500 parameters, the fit store's record was measured with 900" in change.text


def test_only_the_first_model_a_run_reports_is_checked() -> None:
    """Each rank reports its model at its first step: the first report decides, once. A later rank's
    other model (another pipeline stage) neither restarts the run nor rewrites the record; it is
    only added to the models this run's measurements are stored with."""
    store = StagesStore()
    tuner = SizeTuner(16, 1, 0.1, store=store, key=KEY)  # type: ignore[arg-type]
    assert tuner.starting_micro(16) == 8
    assert tuner.model_seen(ModelPrint("a" * 16, 100, 2), 8) is None  # one of the record's: it steers on
    assert tuner.model_seen(ModelPrint("d" * 16, 700, 5), 8) is None
    assert store.rewrites == [] and tuner.stored_failures == [Point(16, None, False)]
    assert tuner.models == (ModelPrint("a" * 16, 100, 2), ModelPrint("d" * 16, 700, 5))


# --- merged from tests/test_fewer_restarts.py ---------------------------------------------------------------
# Fewer restarts (issue 29): scripted histories through the pure decide/ modules.
#
# A job the fit store measured starts at the largest size known to fit (with the allocator setting it
# fitted with); its key ignores where a run writes but not the script, the device or the limit; after an
# OOM no size the evidence proves cannot fit is tried.


MB = 2**20


def key_for(tmp_path: Path, out: str, limit: int | None = 8 * 2**30, gpus: tuple[tuple[str, int], ...] = ()
            ) -> JobKey:
    command = ["python", "train.py", "--batch-size", "{micro_batch}", "--output", str(tmp_path / out),
               f"--log={tmp_path / 'runs' / out / 'log.txt'}"]
    writes = [*CheckpointIndex([f"{tmp_path / out}/checkpoint-*"], tmp_path).directories(), tmp_path / "runs" / out]
    return JobKey.for_run(command, tmp_path, writes, gpus, 1, limit)


def test_the_places_a_run_writes_are_not_the_job(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('model v1')\n")
    first, second = key_for(tmp_path, "out-monday"), key_for(tmp_path, "out-tuesday")
    assert first.command.count(OUTPUT) == 1 and "--log={output}" in first.command
    assert first.fingerprint == second.fingerprint
    assert first.files and first.files[0].startswith("train.py:")


def test_a_relative_output_directory_is_output_before_and_after_it_exists(tmp_path: Path) -> None:
    command = ["python", "train.py", "--output", "out", "--bs", "{micro_batch}"]
    writes = CheckpointIndex(["out/checkpoint-*"], tmp_path).directories()
    before = JobKey.for_run(command, tmp_path, writes, (), 1, None)
    (tmp_path / "out").mkdir()
    after = JobKey.for_run(command, tmp_path, writes, (), 1, None)
    assert before.command[3] == OUTPUT and before.fingerprint == after.fingerprint


def test_the_script_the_device_and_the_limit_are(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('model v1')\n")
    base = key_for(tmp_path, "out")
    assert key_for(tmp_path, "out", limit=4 * 2**30).fingerprint != base.fingerprint
    h100 = (("NVIDIA H100 80GB HBM3", 80 * 2**30),)
    on_gpu = key_for(tmp_path, "out", gpus=h100)
    assert on_gpu.fingerprint != base.fingerprint and on_gpu.limit is None  # the GPU's memory is the limit
    (tmp_path / "train.py").write_text("print('model v2: twice the layers')\n")
    assert key_for(tmp_path, "out").fingerprint != base.fingerprint


def test_a_key_made_the_old_way_keeps_its_fingerprint() -> None:
    old = JobKey(("python", "train.py"), (), 1)
    assert old.fingerprint == JobKey(("python", "train.py"), (), 1, None, ()).fingerprint


def test_checkpoint_directories_never_swallow_the_working_directory(tmp_path: Path) -> None:
    index = CheckpointIndex(["ckpt/checkpoint-*", "*.pt", "out/last.pt", "/abs/run-*/model.pt"], tmp_path)
    assert index.directories() == [tmp_path / "ckpt", tmp_path / "out", Path("/abs")]


def test_a_measured_rerun_starts_at_the_largest_fitted_size(tmp_path: Path) -> None:
    store, key = FitStore(tmp_path / "store"), JobKey(("python", "train.py"), (), 1, 2**30)
    first = SizeTuner(64, 1, 0.1, store=store, key=key)
    for micro in (64, 32, 16):
        first.record(micro, None, memory_failed=True)
    first.record(8, None, memory_failed=False)  # no peak reading (no per-process GPU figures): still fits
    again = SizeTuner(64, 1, 0.1, store=store, key=key)
    assert again.starting_micro(64) == 8
    assert {p.micro_batch for p in again.stored_failures} == {16, 32, 64}


def test_on_a_gpu_the_start_keeps_the_allocator_setting_it_fitted_with() -> None:
    plan = Plan(BatchPlan(64, 64))
    on_gpu = policy.start_at_fitted(plan, 8, "job", gpu=True)
    assert on_gpu is not None and on_gpu.plan.batch.micro_batch == 8 and on_gpu.plan.expandable_segments
    assert "expandable_segments:True" in on_gpu.reason
    on_cpu = policy.start_at_fitted(plan, 8, "job")
    assert on_cpu is not None and not on_cpu.plan.expandable_segments


def test_an_earlier_runs_failures_are_never_tried_again() -> None:
    # The re-run met an OOM at 8 anyway (say, other work on the GPU): the store's 16 failed, so
    # nothing at or above 16 is proposed, whatever the line predicts.
    tuner = SizeTuner(64, 1, 0.0, memory_limit=1000, stored_failures=[Point(16, None, False)])
    tuner.points = [Point(4, 300, True), Point(2, 200, True)]  # the line: 100 + 50/sample
    assert unfit(16, tuner.stored_failures) is not None and unfit(12, tuner.stored_failures) is None
    hint = tuner.shrink_hint(32, None)
    assert hint is not None and hint.micro_batch == 8


def test_the_oom_figures_prove_only_sizes_close_to_the_failed_one() -> None:
    # 180 MB of room over 60 MB fixed, the OOM at 64 holding 175 MB and asking 16 MB: scaled to 32
    # that is 60 + (191 - 60) / 2 = 125.5 MB, under the limit: nothing proven.
    figures = OomFigures(64, 16 * MB, 175 * MB, 180 * MB, 60 * MB)
    assert not figures.proves_unfit(32) and figures.proves_unfit(63)
    assert unfit(32, [Point(64, None, False)], figures) is None
    # A request larger than the whole room: the next halving is proven not to fit, and skipped.
    huge = OomFigures(64, 220 * MB, 100 * MB, 180 * MB, 60 * MB)
    assert huge.proves_unfit(32) and not huge.proves_unfit(16)
    why = unfit(32, [], huge)
    assert why is not None and "scaled to 32" in why
    hint = shrink_after_oom([], 64, 64, 180 * MB, 0.0, oom=huge)
    assert hint is not None and hint.micro_batch == 16


def test_the_probes_oom_record_is_the_bound_the_tuner_skips_by() -> None:
    # The probe's oom record at micro-batch 64 under a 30% fraction of an 80 GiB device: 20 GiB held,
    # 30 GiB asked: scaled to 32 that is 25 GiB, over the 24 GiB cap, so 32 is skipped for 16.
    record = {"type": "oom", "device": "cuda:0", "requested_bytes": 30 * 2**30, "allocated_bytes": 20 * 2**30,
              "reserved_bytes": 21 * 2**30, "free_bytes": 2**30, "total_bytes": 80 * 2**30, "fraction": 0.3,
              "micro_batch": 64}
    figures = figures_at_oom(AllocatorOom.from_record(record), 64)
    assert figures is not None and figures.limit_bytes == int(80 * 2**30 * 0.3) and figures.micro_batch == 64
    assert unfit(32, [], figures) is not None and unfit(16, [], figures) is None
    hint = SizeTuner(64, 1, 0.0).shrink_hint(64, None, figures)  # no device sample: the cap is the room
    assert hint is not None and hint.micro_batch == 16
    # Without the request or the limit the observer saw, there is no bound.
    assert figures_at_oom(AllocatorOom.from_record({**record, "requested_bytes": None}), 64) is None
    assert figures_at_oom(None, 64) is None


# --- merged from tests/test_extrapolate.py ------------------------------------------------------------------
# ``--predict-shrink`` without processes: the prediction beyond proof (decide/extrapolate.py) from
# scripted OOM figures, how it changes the policy's decision, how ``--grow`` climbs back after a jump
# that went too far, the probe's forward tracker and the record's fold, and the option's check.




def figures(fraction: float | None, fixed: int = 100 * MB, held: int = 160 * MB, asked: int = 20 * MB,
            limit: int = 180 * MB, micro: int = 64, address_space: bool = False) -> OomFigures:
    return OomFigures(micro, asked, held, limit, fixed, fraction, address_space)


def test_an_early_oom_is_extrapolated_to_a_whole_step() -> None:
    # 80 MB past the fixed 100 MB a quarter through the forward at 64: a whole forward is 5 MB a
    # sample, a step twice that; 10 MB/sample under 180 * 0.9 = 162 MB leaves 62 MB: micro-batch 4.
    oom = figures(0.25)
    assert extrapolate.per_sample(oom) == pytest.approx(10 * MB)
    p = extrapolate.predict_after_oom(oom, 32, 64, 0.1, 1)
    assert p is not None and p.micro_batch == 4 and p.predicted_peak == pytest.approx(140 * MB)
    assert p.reason.startswith("prediction beyond proof: at micro-batch 64 the OOM came 25% through the forward")
    assert "the proven path would try 32" in p.reason and "--grow climbs back" in p.reason


def test_no_figures_leave_the_halving_as_it_is() -> None:
    plan = Plan(BatchPlan(64, 64))
    decision = decide(Failure(1, FailureKind.HOST_OOM, 64), [], plan, PolicyConfig())
    assert decision.plan.batch.micro_batch == 32
    for oom in (None, figures(None), figures(0.25, fixed=0)):
        prediction = extrapolate.predict_after_oom(oom, 32, 64, 0.1, 1)
        assert prediction is None
        assert extrapolate.jump(decision, 64, prediction) is decision


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, float("nan")])
def test_a_fraction_outside_zero_to_one_is_no_figure(fraction: float) -> None:
    assert extrapolate.per_sample(figures(fraction)) is None
    assert extrapolate.predict_after_oom(figures(fraction), 32, 64, 0.1, 1) is None


def test_garbage_in_the_record_is_no_figure() -> None:
    report = AllocatorReport()
    record = {"type": "oom", "device": "cpu", "memory": "address_space", "requested_bytes": 20 * MB,
              "allocated_bytes": 160 * MB, "total_bytes": 180 * MB, "fixed_bytes": 100 * MB, "micro_batch": 64}
    for junk in (0, "half", True, 2.0, None):
        report.take({**record, "forward_fraction": junk})
        assert report.progress is not None and report.progress.forward_fraction is None
    report.take({**record, "memory": "swap", "forward_fraction": 0.5})  # a measure nobody wrote: ignored
    assert report.progress is not None and report.progress.forward_fraction is None
    held_nothing = figures(0.25, held=90 * MB, asked=5 * MB)  # less than the fixed memory: nothing past it
    assert extrapolate.per_sample(held_nothing) is None


def test_a_backward_oom_is_scaled_as_it_is_not_doubled() -> None:
    # The forward had returned: the 80 MB held past the fixed memory at 64 already include the forward.
    oom = figures(1.0)
    assert extrapolate.per_sample(oom) == pytest.approx(80 * MB / 64)
    p = extrapolate.predict_after_oom(oom, 32, 64, 0.1, 1)
    assert p is None  # 1.25 MB/sample: 32 is predicted to fit, no jump below the halving
    late = figures(1.0, held=175 * MB, asked=60 * MB)  # 135 MB at 64 in the backward: 2.1 MB/sample
    p = extrapolate.predict_after_oom(late, 32, 64, 0.1, 1)
    assert p is not None and p.micro_batch == 16 and "after the forward had returned" in p.reason


def test_a_prediction_below_the_floor_stops_at_min_micro() -> None:
    oom = figures(0.01)  # 80 MB a hundredth of the way: 250 MB a sample, nothing fits
    p = extrapolate.predict_after_oom(oom, 32, 64, 0.1, 4)
    assert p is not None and p.micro_batch == 4 and "--min-micro-batch 4" in p.reason
    assert extrapolate.predict_after_oom(oom, 4, 64, 0.1, 4) is None  # the proven path is at the floor already
    assert extrapolate.predict_after_oom(figures(0.25), 32, 64, 0.1, 8) is not None
    assert extrapolate.predict_after_oom(figures(0.25), 32, 64, 0.1, 8).micro_batch == 8  # type: ignore[union-attr]


def test_only_a_jump_below_the_proven_choice_is_taken() -> None:
    # The proven path already goes to 2 (the model's hint): a prediction of 4 is no jump.
    assert extrapolate.predict_after_oom(figures(0.25), 2, 64, 0.1, 1) is None
    assert extrapolate.predict_after_oom(figures(0.25), 4, 64, 0.1, 1) is None


def test_under_rlimit_as_the_margin_is_of_the_room_above_the_mapped_libraries() -> None:
    # 700 MB mapped before the forward, 48 MB of room: 0.9 x 748 MB would leave no room at all.
    oom = figures(0.5, fixed=700 * MB, held=740 * MB, asked=16 * MB, limit=748 * MB, address_space=True)
    p = extrapolate.predict_after_oom(oom, 32, 64, 0.1, 1)
    assert p is not None and p.micro_batch == 8  # 3.5 MB/sample under 700 + 43.2 MB: at most 12
    allocated = extrapolate.predict_after_oom(OomFigures(64, 16 * MB, 740 * MB, 748 * MB, 700 * MB, 0.5), 32, 64,
                                              0.1, 1)
    assert allocated is not None and allocated.micro_batch == 1 and "--min-micro-batch 1" in allocated.reason


def test_the_jump_changes_only_a_decision_that_shrinks() -> None:
    plan = Plan(BatchPlan(64, 64))
    shrink = decide(Failure(1, FailureKind.HOST_OOM, 64), [], plan, PolicyConfig())
    prediction = extrapolate.predict_after_oom(figures(0.25), shrink.plan.batch.micro_batch, 64, 0.1, 1)
    jumped = extrapolate.jump(shrink, 64, prediction)
    assert (jumped.plan.batch.micro_batch, jumped.plan.batch.grad_accum, jumped.plan.batch.global_batch) == (4, 16, 64)
    assert jumped.reason.startswith(shrink.reason) and "prediction beyond proof" in jumped.reason
    same_size = shrink.__class__(shrink.action, plan, "fragmentation: retrying micro-batch 64")
    assert extrapolate.jump(same_size, 64, prediction) is same_size  # a retry at the failed size stays one


def test_grow_climbs_back_after_a_jump_too_far() -> None:
    # Truth: fixed 100 MB + 3 MB/sample, budget 180 * 0.9 = 162 MB: 16 fits (148 MB), 32 does not.
    # The jump went to 2; the attempt there measured its peak. Growth goes up, below the failure.
    points = [Point(64, None, False), Point(2, 106 * MB, True)]
    first = propose_growth(points, 2, 64, 180 * MB, 0.1, fixed_bytes=100 * MB)
    assert first is not None and first.micro_batch == 16
    # Without the measured fixed memory one point assumes none: 53 MB/sample, nothing larger fits.
    assert propose_growth(points, 2, 64, 180 * MB, 0.1) is None
    points.append(Point(16, 148 * MB, True))
    assert propose_growth(points, 16, 64, 180 * MB, 0.1, fixed_bytes=100 * MB) is None  # 32 would not fit


def test_the_tuner_learns_the_floor_and_the_limit_from_an_address_space_oom() -> None:
    report = AllocatorReport()
    report.take({"type": "oom", "device": "cpu", "memory": "address_space", "requested_bytes": 32 * MB,
                 "allocated_bytes": 770 * MB, "total_bytes": 784 * MB, "fixed_bytes": 736 * MB,
                 "forward_fraction": 0.07, "micro_batch": 64})
    oom = figures_at_oom(None, 64, report.progress)
    assert oom is not None and oom.address_space and oom.forward_fraction == 0.07 and oom.fixed_bytes == 736 * MB
    tuner = SizeTuner(64, 1, 0.05)
    tuner.learn(oom)
    assert (tuner.allocator_limit, tuner.address_space, tuner.fixed_bytes) == (784 * MB, True, 736 * MB)
    assert tuner.peak_bytes(None, None, AllocatorReport()) is None  # no RSS point on an address-space line
    report.take({"type": "step", "step": 3, "steps": 1, "pid": 1, "vm_limit_bytes": 784 * MB,
                 "vm_peak_bytes": 760 * MB, "devices": {}})
    assert tuner.peak_bytes(None, None, report) == 760 * MB
    # What the worker held right after its first optimizer step (its optimizer state made) is the
    # line's fixed memory from then on: 740 MB, not the 736 MB before the first forward.
    report.take({"type": "step", "step": 4, "steps": 1, "pid": 1, "vm_limit_bytes": 784 * MB,
                 "vm_peak_bytes": 760 * MB, "devices": {}, "held_after_first_step": {"address_space": 740 * MB}})
    assert report.held_after_step == {"address_space": 740 * MB}
    assert tuner.peak_bytes(None, None, report) == 760 * MB and tuner.fixed_bytes == 740 * MB
    tuner.learn(oom)  # an OOM's figure from before the first forward never lowers it
    assert tuner.fixed_bytes == 740 * MB
    tuner.fixed_bytes = 736 * MB
    # The room above the floor is 48 MB less its 5 %: 45.6 MB. 12 MB a sample at 2 leaves no larger
    # divisor of 64 (4 would need 48 MB); 6 MB a sample reaches 4 (7 would, 8 would not).
    assert tuner.growth(2, 760 * MB, None) is None
    grow = tuner.growth(2, 748 * MB, None)
    assert grow is not None and grow.micro_batch == 4


class Leaf(torch.nn.Module):
    def __init__(self, fail: list[bool]) -> None:
        super().__init__()
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail[0]:
            raise MemoryError("no room")
        return x + 1


def test_the_tracker_counts_leaf_forwards_and_knows_when_the_forward_returned() -> None:
    fail = [False]
    model = torch.nn.Sequential(Leaf([False]), torch.nn.Sequential(Leaf([False]), Leaf(fail)), Leaf([False]))
    tracker = ForwardTracker(torch)
    tracker.arm()
    try:
        fail[0] = True
        with pytest.raises(MemoryError):
            model(torch.zeros(2))  # first forward: two of four leaves entered, the second failing
        first = tracker.figures("rss")
        assert (first["forward_basis"], first["forward_leaves"], first["forward_fraction"]) == ("modules", 3, 0.75)
        assert isinstance(first["fixed_bytes"], int) and first["fixed_bytes"] > 0
        tracker.forget()
        fail[0] = False
        model(torch.zeros(2))
        done = tracker.figures("rss")
        assert (done["forward_basis"], done["forward_fraction"]) == ("done", 1.0)
        fail[0] = True
        with pytest.raises(MemoryError):
            model(torch.zeros(2))
        learned = tracker.figures("rss")
        assert (learned["forward_basis"], learned["forward_fraction"]) == ("learned", 0.75)
    finally:
        tracker.disarm()
    fail[0] = False
    model(torch.zeros(2))
    assert tracker.figures("rss")["forward_fraction"] == 0.75  # disarmed: nothing counted since


def test_predict_shrink_needs_grow() -> None:
    with pytest.raises(UsageError) as exc:
        build_config({"micro_batch": "8", "grad_accum": "1", "predict_shrink": True}, ["python", "x.py"])
    assert "--predict-shrink" in str(exc.value) and "--grow" in str(exc.value)
    config = build_config({"micro_batch": "8", "grad_accum": "1", "predict_shrink": True, "grow": True},
                          ["python", "x.py"])
    assert config.batch.predict_shrink and config.batch.grow


def test_a_forward_an_oom_aborted_does_not_count_into_the_next() -> None:
    """A script that catches the OOM and retries smaller: the aborted forward's modules never
    returned, so the retry's outermost module is entered again; it starts a new forward."""
    fail = [True]
    model = torch.nn.Sequential(Leaf([False]), torch.nn.Sequential(Leaf([False]), Leaf(fail)), Leaf([False]))
    tracker = ForwardTracker(torch)
    tracker.arm()
    try:
        with pytest.raises(MemoryError):
            model(torch.zeros(2))  # caught by the script: no forget(), no process end
        fail[0] = False
        model(torch.zeros(2))
        done = tracker.figures("rss")
        assert (done["forward_basis"], done["forward_leaves"], done["forward_fraction"]) == ("done", 4, 1.0)
        fail[0] = True
        with pytest.raises(MemoryError):
            model(torch.zeros(2))
        again = tracker.figures("rss")
        assert (again["forward_basis"], again["forward_leaves"], again["forward_fraction"]) == ("learned", 3, 0.75)
    finally:
        tracker.disarm()


# --- merged from tests/test_extrapolate_pins.py -------------------------------------------------------------
# Pins for the survivors of mutation testing in decide/extrapolate.py (docs/mutation.md): the size
# ``--predict-shrink`` restarts at, the reason's figures, the floor and the proven size as its bounds,
# and which of the policy's decisions the jump changes.


EARLY = OomFigures(64, 20 * MB, 160 * MB, 180 * MB, 100 * MB, 0.25)  # 80 MB past the fixed a quarter in


def test_the_reason_gives_every_figure_of_the_prediction() -> None:
    assert extrapolate.predict_after_oom(EARLY, 32, 64, 0.1, 1) == Prediction(
        4, 140 * MB,
        "prediction beyond proof: at micro-batch 64 the OOM came 25% through the forward holding 167772160 B "
        "(fixed 104857600 B) and asking 20971520 B more: 1.05e+07 B/sample for a whole step (twice the forward), "
        "so micro-batch 4, predicted to need 1.47e+08 B under the budget 1.7e+08 B "
        "(the proven path would try 32; the next attempt checks it, --grow climbs back)")


def test_a_size_predicted_at_exactly_the_budget_is_taken() -> None:
    # 32 MB past the fixed 100 MB half through the forward at 64: 2.5 MB a sample for a step, so 4
    # needs exactly the 110 MB limit (no margin); 8 would need 120 MB.
    oom = OomFigures(64, 8 * MB, 132 * MB, 110 * MB, 100 * MB, 0.5)
    p = extrapolate.predict_after_oom(oom, 32, 64, 0.0, 1)
    assert p is not None and (p.micro_batch, p.predicted_peak) == (4, 110 * MB)


def test_a_predicted_size_at_the_floor_is_named_as_the_prediction_not_the_floor() -> None:
    p = extrapolate.predict_after_oom(EARLY, 32, 64, 0.1, 4)
    assert p is not None and p.micro_batch == 4
    assert "so micro-batch 4, predicted to need 1.47e+08 B under" in p.reason and "--min-micro-batch" not in p.reason
    floor = extrapolate.predict_after_oom(EARLY, 32, 64, 0.1, 8)
    assert floor is not None and floor.micro_batch == 8 and floor.predicted_peak == 180 * MB
    assert "so --min-micro-batch 8 (nothing at or above it is predicted to fit) under the budget" in floor.reason


def test_a_floor_that_would_break_the_global_batch_is_no_prediction() -> None:
    # Nothing is predicted to fit, and --min-micro-batch 3 does not divide 64: the proven path goes on.
    hopeless = OomFigures(64, 20 * MB, 160 * MB, 180 * MB, 100 * MB, 0.01)
    assert extrapolate.predict_after_oom(hopeless, 32, 64, 0.1, 3) is None
    assert extrapolate.predict_after_oom(hopeless, 32, 64, 0.1, 4) is not None


def test_an_earlier_failure_below_the_failed_size_bounds_the_prediction() -> None:
    # The backward OOM at 64 predicts 16 fits (1.8 MB a sample), but 16 already failed: 8.
    late = OomFigures(64, 55 * MB, 160 * MB, 180 * MB, 100 * MB, 1.0)
    p = extrapolate.predict_after_oom(late, 32, 64, 0.1, 1, [Point(16, None, False)])
    assert p is not None and p.micro_batch == 8
    assert "at micro-batch 64 the OOM came after the forward had returned holding" in p.reason
    assert "a whole step, so micro-batch 8" in p.reason  # a backward OOM is not doubled


def test_one_sample_and_one_byte_of_fixed_memory_are_figures() -> None:
    one = OomFigures(1, 1 * MB, 3 * MB, 3 * MB, 1, 0.5)
    assert extrapolate.per_sample(one) == 2 * (4 * MB - 1) / 0.5


def test_the_jump_reason_is_the_policy_s_then_the_prediction_s_then_the_plan() -> None:
    plan = Plan(BatchPlan(64, 64))
    shrink = decide(Failure(1, FailureKind.HOST_OOM, 64), [], plan, PolicyConfig())
    prediction = Prediction(4, 1.0, "predicted")
    jumped = extrapolate.jump(shrink, 64, prediction)
    assert jumped.reason == f"{shrink.reason}; predicted: micro-batch 4 × accumulation 16 × world 1 = 64"
    assert (jumped.action, jumped.delay) == (shrink.action, shrink.delay)


def test_the_jump_leaves_a_give_up_an_equal_size_and_a_size_the_plan_cannot_run() -> None:
    plan = Plan(BatchPlan(64, 64))
    shrink = decide(Failure(1, FailureKind.HOST_OOM, 64), [], plan, PolicyConfig())
    assert extrapolate.jump(shrink, 64, Prediction(32, 1.0, "same")) is shrink
    give_up = replace(shrink, action=Action.GIVE_UP)  # e.g. at the floor with nothing left
    assert extrapolate.jump(give_up, 64, Prediction(4, 1.0, "predicted")) is give_up
    assert extrapolate.jump(shrink, 64, Prediction(3, 1.0, "not a divisor")) is shrink


def test_nothing_held_past_the_fixed_memory_is_no_figure_but_one_byte_is() -> None:
    assert extrapolate.per_sample(OomFigures(64, 20 * MB, 80 * MB, 180 * MB, 100 * MB, 0.5)) is None
    assert extrapolate.per_sample(OomFigures(64, 20 * MB + 1, 80 * MB, 180 * MB, 100 * MB, 0.5)) == 2 / 0.5 / 64
