"""The recovery policy's decisions pinned where mutation testing (bench/mutation.py) found them loose:
the reasons users read, the boundaries of each remedy and the plan carried through give-ups."""

from __future__ import annotations

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.attribution import Attribution, Cause
from oomguard.supervisor.decide.classify import FailureKind, Fatal
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide

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
