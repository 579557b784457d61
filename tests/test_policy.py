"""The recovery policy over scripted histories: no processes, no clock."""

from __future__ import annotations

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide

OOM, CRASH, HANG, KILLED = FailureKind.CUDA_OOM, FailureKind.CRASH, FailureKind.HANG, FailureKind.KILLED


def plan(micro: int, global_batch: int = 96, world: int = 1) -> Plan:
    return Plan(BatchPlan(micro, global_batch, world))


def run_history(kinds: list[FailureKind], start: Plan, config: PolicyConfig) -> list[tuple[int, int, str]]:
    """Feed failures one after another; returns (micro, accum, action) after each."""
    history: list[Failure] = []
    current, out = start, []
    for i, kind in enumerate(kinds, 1):
        failure = Failure(i, kind, current.batch.micro_batch, evidence="same")
        d = decide(failure, history, current, config)
        history.append(failure)
        current = d.plan
        out.append((current.batch.micro_batch, current.batch.grad_accum, d.action.value))
    return out


def test_oom_halves_to_largest_divisor_and_keeps_global_batch_exact() -> None:
    # 96 = 2^5 * 3: 32 -> 16 -> 8 -> 4 -> 3? no: at most half of 4 is 2.
    steps = run_history([OOM] * 5, plan(32), PolicyConfig())
    assert [s[:2] for s in steps] == [(16, 6), (8, 12), (4, 24), (2, 48), (1, 96)]
    assert all(m * a == 96 for m, a, _ in steps)


def test_divisor_not_exact_half() -> None:
    # per-process batch 24 at micro 12 -> half is 6; from 6 -> 3; from 3 -> 1 (largest divisor <= 1)
    steps = run_history([OOM, OOM, OOM], plan(12, 24), PolicyConfig())
    assert [s[0] for s in steps] == [6, 3, 1]
    # 36 at micro 9: half is 4 -> largest divisor of 36 that is <= 4 is 4.
    assert run_history([OOM], plan(9, 36), PolicyConfig())[0][:2] == (4, 9)


def test_world_size_is_part_of_the_arithmetic() -> None:
    d = decide(Failure(1, OOM, 16), [], plan(16, 128, world=4), PolicyConfig())
    assert (d.plan.batch.micro_batch, d.plan.batch.grad_accum, d.plan.batch.world_size) == (8, 4, 4)
    assert d.plan.batch.micro_batch * d.plan.batch.grad_accum * 4 == 128


def test_floor_then_fallbacks_then_give_up() -> None:
    config = PolicyConfig(min_micro_batch=8, fallback_count=2)
    steps = run_history([OOM] * 4, plan(16, 64), config)
    assert steps[0] == (8, 8, "restart")
    assert steps[1] == (8, 8, "restart") and steps[2] == (8, 8, "restart")
    assert steps[3][2] == "give_up"
    history = [Failure(1, OOM, 16)]
    d = decide(Failure(2, OOM, 8), history, Plan(BatchPlan(8, 64), True, fallbacks_applied=2), config)
    assert d.action is Action.GIVE_UP and "does not fit" in d.reason


def test_fragmentation_first_sets_expandable_segments_at_same_batch() -> None:
    failure = Failure(1, OOM, 16, fragmented=True)
    d = decide(failure, [], plan(16), PolicyConfig())
    assert d.plan.expandable_segments and d.plan.batch.micro_batch == 16
    d2 = decide(Failure(2, OOM, 16, fragmented=True), [failure], d.plan, PolicyConfig())
    assert d2.plan.batch.micro_batch == 8 and d2.plan.expandable_segments


def test_host_oom_and_memory_limit_shrink_too() -> None:
    for kind in (FailureKind.HOST_OOM, FailureKind.MEMORY_LIMIT):
        assert decide(Failure(1, kind, 16), [], plan(16), PolicyConfig()).plan.batch.micro_batch == 8


def test_crash_backoff_doubles_and_is_capped() -> None:
    config = PolicyConfig(max_restarts=10, backoff=1.0, max_backoff=4.0)
    history: list[Failure] = []
    delays = []
    for i, kind in enumerate([CRASH, HANG, KILLED, CRASH, HANG], 1):
        f = Failure(i, kind, 8, evidence=f"e{i}")
        d = decide(f, history, plan(8), config)
        history.append(f)
        delays.append(d.delay)
        assert d.plan.batch.micro_batch == 8
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0]


def test_crash_loop_gives_up() -> None:
    steps = run_history([CRASH] * 3, plan(8), PolicyConfig(max_restarts=10))
    assert [s[2] for s in steps] == ["restart", "restart", "give_up"]


def test_new_checkpoint_breaks_crash_loop_and_resets_backoff() -> None:
    config = PolicyConfig(max_restarts=10)
    h = [Failure(1, CRASH, 8, "same"), Failure(2, CRASH, 8, "same", new_checkpoint=True)]
    d = decide(Failure(3, CRASH, 8, "same"), h, plan(8), config)
    assert d.action is Action.RESTART and d.delay == 2.0
    d = decide(Failure(3, CRASH, 8, "same", new_checkpoint=True), h, plan(8), config)
    assert d.delay == 1.0


def test_max_restarts_counts_only_non_memory_failures() -> None:
    config = PolicyConfig(max_restarts=2)
    history = [Failure(1, OOM, 32), Failure(2, OOM, 16), Failure(3, CRASH, 8, "a"), Failure(4, HANG, 8, "b")]
    assert decide(Failure(5, OOM, 8), history, plan(8), config).action is Action.RESTART
    assert decide(Failure(5, KILLED, 8, "c"), history, plan(8), config).action is Action.GIVE_UP


def test_load_error_marks_checkpoint_bad_and_keeps_batch() -> None:
    f = Failure(1, CRASH, 8, "x", checkpoint="/ck/checkpoint-4", load_error=True)
    d = decide(f, [], plan(8), PolicyConfig())
    assert d.bad_checkpoint == "/ck/checkpoint-4" and d.plan == plan(8) and d.restart


def test_fit_hint_is_used_when_valid() -> None:
    d = decide(Failure(1, OOM, 32), [], plan(32), PolicyConfig(), fit_hint=6)
    assert d.plan.batch.micro_batch == 6
    d = decide(Failure(1, OOM, 48), [], plan(48), PolicyConfig(), fit_hint=32)  # backed by the model
    assert d.plan.batch.micro_batch == 32 and d.plan.batch.grad_accum == 3
    for bad in (30, 48, 96, 0):  # not a divisor, not smaller, below the floor
        d = decide(Failure(1, OOM, 48), [], plan(48), PolicyConfig(min_micro_batch=2), fit_hint=bad)
        assert d.plan.batch.micro_batch == 24
