"""The size tuner's bookkeeping that mutation testing showed unpinned (docs/mutation.md): the points
a restarted supervisor rebuilds from its journal, which peak and which capacity count, what is
recorded and what a failing fit store costs, and the GPU peak the model predicts."""

from __future__ import annotations

from typing import Any

import pytest

from oomguard.supervisor.observe.allocator import AllocatorOom, AllocatorReport, OomProgress
from oomguard.supervisor.observe.gpu import GpuReading
from oomguard.supervisor.observe.sampler import AttemptPeak, MemorySample
from oomguard.supervisor.record.fitstore import JobKey
from oomguard.supervisor.sizing.memmodel import OomFigures, Point
from oomguard.supervisor.sizing.tuning import FitRecord, ModelPrint, SizeTuner, figures_at_oom

GIB = 2**30
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
