"""The recovery policy over scripted histories: no processes, no clock."""

from __future__ import annotations

import pytest

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide import policy
from oomguard.supervisor.decide.attribution import Attribution, Cause
from oomguard.supervisor.decide.classify import FailureKind, Fatal
from oomguard.supervisor.decide.policy import (
    CRASH_LOOP_REPEATS,
    FREE_SHARE,
    FREE_SPARES,
    POOL,
    Action,
    Decision,
    Failure,
    Plan,
    PlanChange,
    PolicyConfig,
    Source,
    decide,
    reserve_fits,
    spares_to_start,
)

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


# --- merged from tests/test_policy_pins.py ------------------------------------------------------------------
# The recovery policy's decisions pinned where mutation testing (bench/mutation.py) found them loose:
# the reasons users read, the boundaries of each remedy and the plan carried through give-ups.


PLAN = Plan(BatchPlan(16, 64, 1))
CONFIG = PolicyConfig(min_micro_batch=1)
OOM, HOST_OOM, CRASH = FailureKind.CUDA_OOM, FailureKind.HOST_OOM, FailureKind.CRASH


def blamed(cause: Cause, attempt: int = 1, new_checkpoint: bool = True, also: Cause | None = None) -> Failure:
    return Failure(attempt, HOST_OOM, 16, "killed", new_checkpoint=new_checkpoint,
                   attribution=Attribution(cause, f"{cause.value}: the figures", also=also))


# --- memory failures: the batch path -------------------------------------------------------------


def test_fragmentation_restarts_at_the_same_size_and_says_why() -> None:
    d = decide(Failure(1, OOM, 16, fragmented=True), [], PLAN, CONFIG)
    assert d.action is Action.RESTART and d.plan.batch == PLAN.batch and d.plan.expandable_segments
    assert d.reason == ("fragmentation: a large share of the memory reserved-but-unallocated; retrying "
                        "micro-batch 16 with expandable_segments:True")


def test_a_cuda_oom_shrinks_and_sets_the_allocator_option_in_the_same_restart() -> None:
    d = decide(Failure(1, OOM, 16), [], PLAN, CONFIG)
    assert d.reason == ("cuda_oom at micro-batch 16: micro-batch 8 × accumulation 8 × world 1 = 64"
                        " (and expandable_segments:True)")


def test_at_the_floor_the_allocator_option_is_the_last_thing_tried() -> None:
    d = decide(Failure(1, OOM, 16), [], PLAN, PolicyConfig(min_micro_batch=16))
    assert d.action is Action.RESTART and d.plan.expandable_segments and d.plan.batch == PLAN.batch
    assert d.reason == "cuda_oom at the smallest micro-batch 16; retrying with expandable_segments:True"


def test_a_fallback_at_the_floor_names_the_floor_and_counts_the_fallbacks() -> None:
    d = decide(Failure(1, HOST_OOM, 16), [], PLAN, PolicyConfig(min_micro_batch=16, fallback_count=2))
    assert d.plan.fallbacks_applied == 1
    assert d.reason == "host_oom at the smallest micro-batch 16; adding fallback 1 of 2"


def test_giving_up_at_the_floor_says_the_model_does_not_fit_and_what_to_do() -> None:
    d = decide(Failure(1, HOST_OOM, 16), [], PLAN, PolicyConfig(min_micro_batch=16))
    assert d.action is Action.GIVE_UP and d.plan == PLAN
    assert d.reason.endswith("the model does not fit; use a larger GPU, fewer parameters or more --fallback-args")


def test_the_memory_models_hint_may_be_the_smallest_size_allowed() -> None:
    d = decide(Failure(1, HOST_OOM, 16), [], PLAN, CONFIG, fit_hint=1)
    assert d.plan.batch.micro_batch == 1


def test_a_memory_failure_from_a_good_checkpoint_marks_nothing_bad() -> None:
    d = decide(Failure(1, HOST_OOM, 16, checkpoint="ckpt-60"), [], PLAN, CONFIG)
    assert d.bad_checkpoint is None and d.plan.batch.micro_batch == 8


def test_a_checkpoint_that_cannot_be_loaded_is_named_in_the_reason() -> None:
    d = decide(Failure(1, CRASH, 16, checkpoint="ckpt-60", load_error=True), [], PLAN, CONFIG)
    assert d.reason == "checkpoint ckpt-60 could not be loaded; resuming from the previous one"


# --- memory failures: the remedy for each cause --------------------------------------------------


def test_a_per_sample_failure_takes_the_batch_path_unchanged() -> None:
    unattributed = decide(Failure(1, HOST_OOM, 16, "killed"), [], PLAN, CONFIG)
    assert decide(blamed(Cause.PER_SAMPLE), [], PLAN, CONFIG) == unattributed


def test_an_eval_batch_halves_down_to_one_then_the_training_batch_follows() -> None:
    for own, after in ((32, 16), (3, 1), (2, 1)):
        d = decide(blamed(Cause.EVALUATION), [], Plan(PLAN.batch, eval_micro_batch=own), CONFIG)
        assert d.action is Action.RESTART and d.plan.batch == PLAN.batch
        assert d.plan.eval_micro_batch == after and isinstance(d.plan.eval_micro_batch, int)
        assert d.reason == (f"evaluation: the figures: eval micro-batch {own} -> {after}; "
                            "training micro-batch stays 16")
    at_one = decide(blamed(Cause.EVALUATION), [], Plan(PLAN.batch, eval_micro_batch=1), CONFIG)
    assert at_one.plan.eval_micro_batch == 1 and at_one.plan.batch.micro_batch == 8


def test_dataloader_workers_halve_to_whole_numbers() -> None:
    d = decide(blamed(Cause.DATA_LOADER), [], Plan(PLAN.batch, num_workers=3), CONFIG)
    assert d.action is Action.RESTART and d.plan.num_workers == 1 and isinstance(d.plan.num_workers, int)


def test_a_checkpoint_phase_restarts_with_its_summary_and_gives_up_keeping_the_plan() -> None:
    first = decide(blamed(Cause.SAVING), [], PLAN, CONFIG)
    assert first.reason == ("checkpoint_saving: the figures: its memory does not follow the micro-batch; "
                            "restarting at micro-batch 16 from the newest good checkpoint")
    again = decide(blamed(Cause.SAVING, 2, new_checkpoint=False), [blamed(Cause.SAVING)], PLAN, CONFIG)
    assert again.action is Action.GIVE_UP and again.plan == PLAN


def test_a_first_leak_restarts_even_without_a_new_checkpoint() -> None:
    d = decide(blamed(Cause.LEAK, new_checkpoint=False), [], PLAN, CONFIG)
    assert d.action is Action.RESTART


def test_a_leak_says_whether_its_growth_or_the_batch_used_the_room() -> None:
    plain = decide(blamed(Cause.LEAK), [], PLAN, CONFIG)
    assert plain.reason.endswith("from the newest checkpoint (the batch is not to blame)")
    spiked = decide(blamed(Cause.LEAK, also=Cause.PER_SAMPLE), [], PLAN, CONFIG)
    assert spiked.reason.endswith("(the leak's growth, not the batch, used the room)")


def test_a_leak_without_progress_gives_up_keeping_the_plan_and_says_what_to_fix() -> None:
    d = decide(blamed(Cause.LEAK, 2, new_checkpoint=False), [blamed(Cause.LEAK)], PLAN, CONFIG)
    assert d.action is Action.GIVE_UP and d.plan == PLAN
    assert d.reason == ("leak: the figures: it brings the worker down before it writes a checkpoint (no progress "
                        "between restarts), so restarting cannot finish the run; fix the leak or checkpoint more often")


# --- other failures ------------------------------------------------------------------------------


def test_a_crash_restarts_at_the_same_batch_saying_after_how_long() -> None:
    d = decide(Failure(1, CRASH, 16, "boom"), [], PLAN, PolicyConfig(backoff=2.0))
    assert d.reason == "crash: restarting at the same batch after 2 s" and d.delay == 2.0


def test_the_backoff_starts_over_after_a_memory_failure() -> None:
    history = [Failure(1, CRASH, 16, "a"), Failure(2, OOM, 16)]
    d = decide(Failure(3, CRASH, 8, "b"), history, PLAN, PolicyConfig(backoff=1.0))
    assert d.delay == 1.0


def test_used_up_restarts_give_up_keeping_the_plan_and_naming_the_last_failure() -> None:
    d = decide(Failure(1, CRASH, 16, "Segmentation fault"), [], PLAN, PolicyConfig(max_restarts=0))
    assert d.action is Action.GIVE_UP and d.plan == PLAN
    assert d.reason == "crash again and --max-restarts 0 is used up; last: Segmentation fault"


def test_a_crash_loop_is_the_last_three_failures_whatever_came_before() -> None:
    history = [Failure(1, CRASH, 16, "other"), Failure(2, CRASH, 16, "same"), Failure(3, CRASH, 16, "same")]
    d = decide(Failure(4, CRASH, 16, "same"), history, PLAN, CONFIG)
    assert d.action is Action.GIVE_UP
    assert d.reason == "crash loop: crash 3 times in a row with no new checkpoint; last: same"


# --- a restarted supervisor ----------------------------------------------------------------------


def test_a_plan_saved_before_eval_and_workers_existed_keeps_the_current_ones() -> None:
    saved = Plan(BatchPlan(8, 64, 1)).as_dict()
    del saved["eval_micro_batch"], saved["num_workers"]
    resumed = Plan(PLAN.batch, eval_micro_batch=4, num_workers=2).resumed(saved)
    assert resumed == Plan(BatchPlan(8, 64, 1), eval_micro_batch=4, num_workers=2)


def test_an_error_no_restart_fixes_ends_the_run_with_its_plan() -> None:
    wandb = Fatal("ModuleNotFoundError: No module named 'wandb'")
    first, second = (Failure(n, FailureKind.CRASH, 16, fatal=wandb) for n in (1, 2))
    decision = decide(second, [first], PLAN, CONFIG)
    assert decision.action is Action.GIVE_UP and decision.plan == PLAN  # the journal and status show the plan


def test_a_hang_or_a_kill_after_an_error_line_is_retried_as_before() -> None:
    # The script printed an import error it survived (an optional package), then hung or was killed:
    # the line is no reason to end the run, only a crash with it is.
    wandb = Fatal("ModuleNotFoundError: No module named 'wandb'")
    for kind in (FailureKind.HANG, FailureKind.KILLED):
        first, second = (Failure(n, kind, 16, fatal=wandb) for n in (1, 2))
        decision = decide(second, [first], PLAN, CONFIG)
        assert decision.action is Action.RESTART and not decision.unfixable


def test_a_script_that_does_not_compile_is_told_what_to_do() -> None:
    broken = Fatal("SyntaxError: '(' was never closed", alone=True)
    decision = decide(Failure(1, FailureKind.CRASH, 16, fatal=broken), [], PLAN, CONFIG)
    assert decision.reason == ("SyntaxError: '(' was never closed: the script does not compile, so no restart can "
                               "fix it; fix the script and run oomguard again")


# --- merged from tests/test_policy_edges.py -----------------------------------------------------------------
# The policy's edges, each pinned where a one-character change would move it (issue 30): the
# crash-loop rule reads the evidence, ``--max-restarts N`` allows exactly N restarts, and a saved plan
# is resumed only for the same world size and global batch.


CRASH, HANG, OOM = FailureKind.CRASH, FailureKind.HANG, FailureKind.CUDA_OOM


def plan_at(micro: int = 8, global_batch: int = 96, world: int = 1) -> Plan:
    return Plan(BatchPlan(micro, global_batch, world))


def actions(failures: list[Failure], config: PolicyConfig) -> list[str]:
    """The action after each failure, each decided with the ones before it as history."""
    return [decide(f, failures[:i], plan_at(), config).action.value for i, f in enumerate(failures)]


def test_the_same_crash_three_times_is_a_crash_loop() -> None:
    same = [Failure(i, CRASH, 8, "ValueError: bad data in shard 7") for i in range(1, CRASH_LOOP_REPEATS + 1)]
    assert actions(same, PolicyConfig(max_restarts=10)) == ["restart"] * (CRASH_LOOP_REPEATS - 1) + ["give_up"]
    last = decide(same[-1], same[:-1], plan_at(), PolicyConfig(max_restarts=10))
    assert last.reason.startswith("crash loop: crash 3 times in a row") and "shard 7" in last.reason


@pytest.mark.parametrize("evidence", [["a", "b", "c"], ["a", "a", "b"], ["a", "b", "b"]])
def test_crashes_whose_evidence_differs_are_not_a_loop(evidence: list[str]) -> None:
    failures = [Failure(i, CRASH, 8, text) for i, text in enumerate(evidence, 1)]
    assert actions(failures, PolicyConfig(max_restarts=10)) == ["restart"] * 3


def test_the_same_evidence_under_another_kind_is_not_a_loop() -> None:
    failures = [Failure(1, CRASH, 8, "x"), Failure(2, HANG, 8, "x"), Failure(3, CRASH, 8, "x")]
    assert actions(failures, PolicyConfig(max_restarts=10)) == ["restart"] * 3


@pytest.mark.parametrize("limit", [0, 1, 4])
def test_max_restarts_n_allows_exactly_n_restarts(limit: int) -> None:
    """Crashes with evidence that differs every time (no crash loop): the Nth is restarted, the
    N+1th ends the run; memory failures between them use none of the budget."""
    failures: list[Failure] = []
    for i in range(1, limit + 2):
        failures += [Failure(2 * i - 1, OOM, 8), Failure(2 * i, CRASH, 8, f"crash {i}")]
    got = actions(failures, PolicyConfig(max_restarts=limit))
    crashes = got[1::2]
    assert crashes == ["restart"] * limit + ["give_up"]
    assert set(got[::2]) == {"restart"}
    final = decide(failures[-1], failures[:-1], plan_at(), PolicyConfig(max_restarts=limit))
    assert final.action is Action.GIVE_UP and f"--max-restarts {limit} is used up" in final.reason


def test_a_saved_plan_is_resumed_for_the_same_job() -> None:
    saved = plan_at(micro=8, global_batch=96, world=2).as_dict()
    resumed = plan_at(micro=48, global_batch=96, world=2).resumed(saved)
    assert resumed is not None and (resumed.batch.micro_batch, resumed.batch.world_size) == (8, 2)


@pytest.mark.parametrize("world", [1, 4])
def test_a_saved_plan_is_not_resumed_after_the_world_size_changed(world: int) -> None:
    """Micro-batch 8 fit on 2 ranks; on another number of ranks the same global batch needs another
    shape, and what fit per rank before says nothing certain: start from what was asked."""
    saved = plan_at(micro=8, global_batch=96, world=2).as_dict()
    assert plan_at(micro=96 // world, global_batch=96, world=world).resumed(saved) is None


def test_a_saved_plan_is_not_resumed_for_another_global_batch() -> None:
    saved = plan_at(micro=8, global_batch=96).as_dict()
    assert plan_at(micro=16, global_batch=64).resumed(saved) is None
    assert plan_at(micro=16, global_batch=96).resumed(None) is None


# Every change of the plan (decide/policy.py) carries its plan, its source and its reason, as the
# journal's plan_change events show them; pinned where mutation testing (bench/mutation.py) found
# only some of the three checked.


PLAN = Plan(BatchPlan(16, 64, 1))


def test_each_change_is_its_plan_its_source_and_its_reason() -> None:
    halved = Plan(BatchPlan(8, 64, 1))
    assert policy.after_failure(Decision(Action.RESTART, halved, "why")) == PlanChange(halved, Source.DECISION, "why")
    assert policy.continue_saved(PLAN, halved.as_dict()) == PlanChange(
        halved, Source.SAVED, "continuing the saved plan at micro-batch 8")
    assert policy.start_at_fitted(PLAN, 8, "job abc") == PlanChange(
        halved, Source.FIT_STORE, "an earlier run of this job fitted micro-batch 8 (job abc)")
    assert policy.grow(halved, 16) == PlanChange(PLAN, Source.GROW, "grow: micro-batch 8 -> 16 × accumulation 4")
    assert policy.planned_restart(PLAN, "leak forecast") == PlanChange(
        PLAN, Source.PLANNED_RESTART, "leak forecast; restarting at micro-batch 16")
    assert policy.allocator_from_environment(PLAN, True) == PlanChange(
        Plan(PLAN.batch, expandable_segments=True), Source.ALLOCATOR,
        "expandable_segments:True is already in the environment")
    assert policy.agreed(PLAN, halved) == PlanChange(
        halved, Source.AGREED, "the nodes' shared plan for this round: micro-batch 8 × accumulation 8 × world 1 = 64")


def test_a_fitted_start_on_a_gpu_says_it_turns_expandable_segments_on() -> None:
    change = policy.start_at_fitted(PLAN, 8, "job abc", gpu=True)
    assert change is not None and change.plan.expandable_segments
    assert change.reason == "an earlier run of this job fitted micro-batch 8 with expandable_segments:True (job abc)"


# --- merged from tests/unit/supervisor/decide/test_sparepool.py: how many spares to start, and when a reserve fits

GIB = 1 << 30


def test_the_reserve_starts_with_the_first_spare_and_the_pool_stops_at_two() -> None:
    assert POOL == 2
    assert spares_to_start(waiting=0, importing=0, reserve=True, behind=True) == 2
    assert spares_to_start(waiting=0, importing=1, reserve=True, behind=True) == 1  # behind the one importing
    assert spares_to_start(waiting=1, importing=0, reserve=True, behind=True) == 1
    assert spares_to_start(waiting=1, importing=1, reserve=True, behind=True) == 0  # never a third
    assert spares_to_start(waiting=2, importing=0, reserve=True, behind=True) == 0
    assert spares_to_start(waiting=5, importing=0, reserve=True, behind=True) == 0


def test_where_a_spare_cannot_wait_behind_another_one_imports_at_a_time() -> None:
    assert spares_to_start(waiting=0, importing=0, reserve=True, behind=False) == 1
    assert spares_to_start(waiting=0, importing=1, reserve=True, behind=False) == 0
    assert spares_to_start(waiting=1, importing=0, reserve=True, behind=False) == 1
    assert spares_to_start(waiting=2, importing=0, reserve=True, behind=False) == 0


def test_without_a_reserve_only_the_next_attempts_spare() -> None:
    for behind in (True, False):
        assert spares_to_start(waiting=0, importing=0, reserve=False, behind=behind) == 1
        assert spares_to_start(waiting=1, importing=0, reserve=False, behind=behind) == 0
        assert spares_to_start(waiting=0, importing=1, reserve=False, behind=behind) == 0


def test_a_reserve_fits_while_a_quarter_of_the_host_and_four_spares_stay_available() -> None:
    total, spare = 24 * GIB, GIB // 2
    floor = FREE_SHARE * total
    assert reserve_fits(int(floor) + spare, total, spare)  # exactly the margin left after it
    assert not reserve_fits(int(floor) + spare - 1, total, spare)
    assert reserve_fits(20 * GIB, total, spare)
    # a small host: four spares' worth is the larger margin
    small, big = 8 * GIB, GIB
    assert FREE_SPARES * big > FREE_SHARE * small
    assert reserve_fits(5 * GIB, small, big) and not reserve_fits(5 * GIB - 1, small, big)
    assert not reserve_fits(3 * GIB, small, big)


# --- merged from tests/test_sparepool_pins.py ---------------------------------------------------------------
# Pins for the spare pool's constants (decide/policy.py), which mutmut 3 never mutates (docs/mutation.md).
#
# The tests above read the host's share from ``FREE_SHARE`` itself, so any share passed it (those
# whose floor is not a whole byte failed only by ``int()`` truncating it): the quarter that
# docs/restart.md promises is pinned here in bytes.


MIB = 1 << 20


def test_a_reserve_leaves_a_quarter_of_the_host_in_bytes() -> None:
    # a 64 GiB host and a 512 MiB spare: the quarter (16 GiB) is the larger margin, four spares are 2 GiB
    total, spare = 64 * GIB, 512 * MIB
    assert reserve_fits(16 * GIB + spare, total, spare)
    assert not reserve_fits(16 * GIB + spare - 1, total, spare)
    # the project's 24 GiB box: 6 GiB must stay available after a reserve
    assert reserve_fits(6 * GIB + spare, 24 * GIB, spare)
    assert not reserve_fits(6 * GIB + spare - 1, 24 * GIB, spare)
