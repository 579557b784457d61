"""``--predict-shrink`` without processes: the prediction beyond proof (sizing/tuning.py) from
scripted OOM figures, how it changes the policy's decision, how ``--grow`` climbs back after a jump
that went too far, the probe's forward tracker and the record's fold, and the option's check."""

from __future__ import annotations

import pytest
import torch

from oomguard.common.batch import BatchPlan
from oomguard.probe.forward import ForwardTracker
from oomguard.supervisor.config import build_config
from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.decide.policy import Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.observe.allocator import AllocatorReport
from oomguard.supervisor.sizing import tuning as extrapolate
from oomguard.supervisor.sizing.memmodel import OomFigures, Point, propose_growth
from oomguard.supervisor.sizing.tuning import SizeTuner, figures_at_oom

MB = 2**20


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
    assert config.predict_shrink and config.grow


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
