"""The cause of a memory failure, the forecast and the remedy per cause: pure functions over
scripted sample series, traceback frames and histories."""

from __future__ import annotations

import random

import pytest

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide.attribution import Attribution, Cause, Evidence, attribute
from oomguard.supervisor.decide.classify import ExitFacts, FailureKind, classify
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.errors import UsageError
from oomguard.supervisor.observe.output import OutputScanner, Phase, phase_of
from oomguard.supervisor.sizing.trend import Budget, Move, Reading, forecast, soonest, steady_rise

MB = 10**6
MIB = 2**20


def leak_series(n: int = 60, base: int = 300 * MB, per_step: int = 4 * MB, steps_per_s: float = 10.0,
                every: float = 1.0, noise: int = 0, seed: int = 1) -> list[Reading]:
    """Samples every ``every`` s of a worker that leaks ``per_step`` bytes a step at a steady rate."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        t = i * every
        step = int(t * steps_per_s)
        out.append(Reading(t, base + step * per_step + rnd.randint(-noise, noise), step))
    return out


def plateau_series(n: int = 60, plateau: int = 800 * MB, noise: int = 5 * MB, seed: int = 2) -> list[Reading]:
    """A per-sample worker: memory climbs in the first steps, then stays at its plateau."""
    rnd = random.Random(seed)
    return [Reading(float(i), min(plateau, (i + 1) * plateau // 4) + rnd.randint(-noise, noise), i * 10)
            for i in range(n)]


# --- trend ---------------------------------------------------------------------------------------


def test_a_steady_leak_is_a_line_with_its_rate_per_step_and_per_second() -> None:
    trend = steady_rise(leak_series(noise=3 * MB))
    assert trend is not None and trend.steady()
    assert trend.per_step == pytest.approx(4 * MB, rel=0.05)
    assert trend.per_s == pytest.approx(40 * MB, rel=0.05)
    assert trend.r2 > 0.99
    assert "4.0 MB/step, 40.0 MB/s" in trend.describe("worker RSS")


def test_a_plateau_after_warmup_is_no_trend() -> None:
    trend = steady_rise(plateau_series())
    assert trend is not None and not trend.steady()
    assert trend.r2 < 0.5


def test_too_few_readings_or_too_short_a_stretch_is_no_trend() -> None:
    assert steady_rise(leak_series(n=6)) is None  # the first reading is warm-up: 5 are too few
    assert steady_rise(leak_series(n=40, every=0.02)) is None  # under 2 s of readings


def test_readings_taken_as_the_worker_dies_do_not_bend_the_line() -> None:
    series = leak_series(n=20)
    series.append(Reading(20.0, 50 * MB, 200))  # the OOM killer freed its memory before the exit was seen
    trend = steady_rise(series)
    assert trend is not None and trend.steady() and trend.per_step == pytest.approx(4 * MB, rel=0.01)


def test_a_tiny_creep_is_not_a_leak() -> None:
    """Allocator caches creep: a perfect line of a few MB over the attempt does not matter."""
    creep = [Reading(float(i), 2000 * MB + i * 100_000, i * 10) for i in range(60)]
    trend = steady_rise(creep)
    assert trend is not None and trend.r2 > 0.99 and not trend.steady()


def test_memory_that_rises_while_no_step_is_taken_is_not_a_leak() -> None:
    """Without training there is no leak per step (a stuck phase, a load): the steps must advance."""
    stuck = [Reading(float(i), 300 * MB + i * 20 * MB, 5 if i >= 3 else i) for i in range(30)]
    trend = steady_rise(stuck)
    assert trend is None or not trend.steady()


def test_without_steps_the_first_quarter_is_warmup() -> None:
    series = [Reading(float(i), (100 if i < 10 else 400) * MB + i * 8 * MB) for i in range(40)]
    trend = steady_rise(series)
    assert trend is not None and trend.readings == 30 and trend.per_step is None
    assert trend.per_s == pytest.approx(8 * MB, rel=0.01)


def test_without_steps_a_rise_of_seconds_is_a_spike_and_one_of_minutes_a_leak() -> None:
    """Measured: a torchrun rank filling a 1.5 GiB cgroup rose 200 MB/s on a line for 6 s before the
    kernel killed it. Without steps, only the rise's length says whether training went on."""
    ramp = [Reading(i * 0.5, 700 * MB + (0 if i < 8 else (i - 8) * 100 * MB)) for i in range(22)]
    trend = steady_rise(ramp)
    assert trend is not None and trend.r2 > 0.9 and not trend.steady()
    assert attribute(ramp, Evidence(), 4).cause is Cause.PER_SAMPLE
    creep = [Reading(float(i), 400 * MB + i * 4 * MB) for i in range(60)]
    assert attribute(creep, Evidence(), 4).cause is Cause.LEAK


def test_memory_that_rises_while_the_reported_step_stands_still_is_no_leak() -> None:
    stuck = [Reading(float(i), 400 * MB + i * 8 * MB, 7) for i in range(60)]
    trend = steady_rise([Reading(0.0, 300 * MB, 5), *stuck])
    assert trend is not None and trend.steps == 0 and not trend.steady()


# --- phase ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("frames,phase", [
    (["<module>", "main", "evaluate", "forward", "_call_impl", "linear"], Phase.EVALUATION),
    (["<module>", "train", "eval_loop"], Phase.EVALUATION),
    (["main", "trainer_fit", "_run_validation", "validation_step"], Phase.EVALUATION),
    (["main", "train", "save_checkpoint", "save", "_save"], Phase.SAVING),
    (["main", "evaluate", "save_pretrained"], Phase.SAVING),  # innermost first: saving inside evaluation
    (["main", "load_checkpoint", "load", "_legacy_load"], Phase.LOADING),
    (["main", "model_load_state_dict", "load_state_dict", "_load_from_state_dict"], Phase.LOADING),
])
def test_the_traceback_names_the_phase(frames: list[str], phase: Phase) -> None:
    found = phase_of(frames, [])
    assert found is not None and found[0] is phase


def test_training_frames_and_dataloader_frames_name_no_phase() -> None:
    assert phase_of(["main", "train_step", "forward", "__next__", "_next_data", "dataloader_iter"],
                    ["Evaluating..."]) is None  # a traceback beats the last output


def test_without_a_traceback_the_last_lines_name_the_phase() -> None:
    assert phase_of([], ["step 100 loss 2.1", "Evaluating at step 100"])[0] is Phase.EVALUATION  # type: ignore[index]
    assert phase_of([], ["Saving checkpoint to out/checkpoint-100"])[0] is Phase.SAVING  # type: ignore[index]
    assert phase_of([], ["step 100 loss 2.1 val_loss 2.3"]) is None


def test_the_scanner_keeps_the_newest_tracebacks_frames_and_a_dead_dataloader_worker() -> None:
    scan = OutputScanner()
    for line in ["Traceback (most recent call last):", '  File "t.py", line 3, in old', "ValueError: x",
                 "Traceback (most recent call last):", '  File "t.py", line 9, in <module>',
                 '  File "t.py", line 5, in evaluate', "RuntimeError: DataLoader worker (pid(s) 4242) exited "
                 "unexpectedly"]:
        scan.feed(line)
    assert scan.frames == ["<module>", "evaluate"]
    assert scan.dataloader and "4242" in scan.dataloader


# --- attribution ---------------------------------------------------------------------------------


def test_attribution_order_dataloader_then_leak_then_phase_then_per_sample() -> None:
    died = Evidence(dataloader="RuntimeError: DataLoader worker (pid 7) is killed by signal: Killed.")
    assert attribute(leak_series(), died, 16).cause is Cause.DATA_LOADER
    in_eval = Evidence(frames=("main", "evaluate"))
    leak = attribute(leak_series(), in_eval, 16)
    assert leak.cause is Cause.LEAK and "it failed in evaluation" in leak.summary
    assert leak.figures["bytes_per_step"] == pytest.approx(4 * MB, rel=0.05) and leak.figures["r2"] > 0.99
    assert attribute(plateau_series(), in_eval, 16).cause is Cause.EVALUATION
    per = attribute(plateau_series(), Evidence(), 16)
    assert per.cause is Cause.PER_SAMPLE and "no steady rise" in per.summary
    assert attribute([], Evidence(), 16).cause is Cause.PER_SAMPLE


def test_per_sample_names_the_plateau_and_the_models_scaling() -> None:
    from oomguard.supervisor.sizing.memmodel import Fit

    per = attribute(plateau_series(), Evidence(), 16, model=Fit(100 * MIB, 40 * MIB, 2))
    assert per.cause is Cause.PER_SAMPLE and "40.0 MiB a sample" in per.summary
    assert per.figures["per_sample_bytes"] == 40 * MIB and "at least" in per.summary  # a lower bound, no plateau


def test_leaks_and_phase_spikes_stay_out_of_the_fit() -> None:
    assert not Cause.LEAK.fits_model and not Cause.EVALUATION.fits_model and not Cause.SAVING.fits_model
    assert Cause.PER_SAMPLE.fits_model


def test_a_dataloader_worker_killed_by_the_oom_killer_is_a_host_oom() -> None:
    scan = OutputScanner()
    scan.feed("RuntimeError: DataLoader worker (pid(s) 4242) exited unexpectedly")
    verdict = classify(ExitFacts(1, 0, 1, "cgroup x"), scan)
    assert verdict.kind is FailureKind.HOST_OOM and "DataLoader worker" in verdict.evidence
    assert classify(ExitFacts(1, 0, 0, "cgroup x"), scan).kind is FailureKind.CRASH  # no OOM kill: a crash


# --- forecast ------------------------------------------------------------------------------------


def test_forecast_minutes_to_the_limit_at_this_rate() -> None:
    series = leak_series(n=60, per_step=1 * MB)  # 10 MB/s
    used = series[-1].used
    fc = forecast(series, Budget("cgroup", used, used + 7200 * MB), None, None)
    assert fc is not None and fc.move is Move.WATCH
    assert fc.seconds_to_limit == pytest.approx(720, rel=0.05)
    assert fc.text.startswith("cgroup limit in ~12 min at this rate")


def test_forecast_plans_the_restart_at_the_last_checkpoint_before_the_limit() -> None:
    series = leak_series(n=60, per_step=1 * MB)  # 10 MB/s
    used = series[-1].used
    budget = Budget("cgroup", used, used + 600 * MB)  # 60 s left
    assert forecast(series, budget, next_checkpoint_in=10, checkpoint_period=120).move is Move.RESTART_AT_NEXT  # type: ignore[union-attr]
    assert forecast(series, budget, next_checkpoint_in=10, checkpoint_period=20).move is Move.WATCH  # type: ignore[union-attr]
    assert forecast(series, budget, next_checkpoint_in=55, checkpoint_period=120).move is Move.CHECKPOINT_NOW  # type: ignore[union-attr]


def test_no_forecast_for_a_plateau_unless_a_leak_rate_is_known() -> None:
    assert forecast(plateau_series(), Budget("GPU", 800 * MB, 1000 * MB), 10, 60) is None
    early = leak_series(n=4)  # too early in the attempt for its own line
    assert forecast(early, Budget("GPU", 400 * MB, 1000 * MB), 10, 60) is None
    known = forecast(early, Budget("GPU", 400 * MB, 1000 * MB), 10, 60, prior_per_s=20 * MB)
    assert known is not None and not known.measured and known.seconds_to_limit == pytest.approx(30)


def test_soonest_budget_wins() -> None:
    series = leak_series()
    a = forecast(series, Budget("cgroup", 0, 4000 * MB), None, None)
    b = forecast(series, Budget("--memory-limit", 0, 2000 * MB), None, None)
    assert soonest([a, None, b]) is b and soonest([None]) is None


# --- remedies ------------------------------------------------------------------------------------

PLAN = Plan(BatchPlan(16, 64, 1))
CONFIG = PolicyConfig(min_micro_batch=1)


def failure(cause: Cause, attempt: int = 1, new_checkpoint: bool = True, micro: int = 16,
            summary: str = "") -> Failure:
    return Failure(attempt, FailureKind.HOST_OOM, micro, "killed", new_checkpoint=new_checkpoint,
                   attribution=Attribution(cause, summary or f"{cause.value}: worker RSS grew 4.0 MB/step, 39.0 MB/s"))


def test_a_leak_restarts_at_the_same_micro_batch() -> None:
    d = decide(failure(Cause.LEAK), [], PLAN, CONFIG)
    assert d.action is Action.RESTART and d.plan == PLAN
    assert "same micro-batch 16" in d.reason and "4.0 MB/step" in d.reason


def test_a_leak_faster_than_checkpoints_gives_up_naming_the_leak_and_its_rate() -> None:
    first = failure(Cause.LEAK)
    d = decide(failure(Cause.LEAK, 2, new_checkpoint=False), [first], PLAN, CONFIG)
    assert d.action is Action.GIVE_UP
    assert "4.0 MB/step, 39.0 MB/s" in d.reason and "no progress between restarts" in d.reason
    assert "\n" not in d.reason


def test_per_sample_still_halves() -> None:
    d = decide(failure(Cause.PER_SAMPLE), [], PLAN, CONFIG)
    assert d.plan.batch.micro_batch == 8 and d.plan.batch.grad_accum == 8


def test_evaluation_halves_the_eval_batch_when_it_has_its_own_else_the_micro_batch() -> None:
    own = decide(failure(Cause.EVALUATION), [], Plan(BatchPlan(16, 64, 1), eval_micro_batch=32), CONFIG)
    assert own.plan.eval_micro_batch == 16 and own.plan.batch.micro_batch == 16
    shared = decide(failure(Cause.EVALUATION), [], PLAN, CONFIG)
    assert shared.plan.batch.micro_batch == 8 and shared.reason.startswith("evaluation")


def test_saving_keeps_the_batch_and_gives_up_when_it_repeats_without_progress() -> None:
    first = decide(failure(Cause.SAVING), [], PLAN, CONFIG)
    assert first.action is Action.RESTART and first.plan == PLAN
    again = decide(failure(Cause.SAVING, 2, new_checkpoint=False), [failure(Cause.SAVING)], PLAN, CONFIG)
    assert again.action is Action.GIVE_UP and "does not follow the micro-batch" in again.reason
    load = decide(failure(Cause.LOADING, 2, new_checkpoint=False), [failure(Cause.LOADING)], PLAN, CONFIG)
    assert load.action is Action.GIVE_UP and "map_location='cpu'" in load.reason


def test_a_dataloader_oom_halves_the_workers_before_the_batch() -> None:
    plan = Plan(BatchPlan(16, 64, 1), num_workers=4)
    d = decide(failure(Cause.DATA_LOADER), [], plan, CONFIG)
    assert d.plan.num_workers == 2 and d.plan.batch.micro_batch == 16
    assert "DataLoader workers 4 -> 2" in d.reason
    none_left = decide(failure(Cause.DATA_LOADER), [], Plan(BatchPlan(16, 64, 1), num_workers=0), CONFIG)
    assert none_left.plan.batch.micro_batch == 8
    assert decide(failure(Cause.DATA_LOADER), [], PLAN, CONFIG).plan.batch.micro_batch == 8  # no {num_workers}


def test_fragmentation_still_comes_first() -> None:
    f = Failure(1, FailureKind.CUDA_OOM, 16, "oom", fragmented=True, attribution=Attribution(Cause.LEAK, "leak"))
    assert decide(f, [], PLAN, CONFIG).plan.expandable_segments


def test_the_plan_keeps_eval_and_workers_across_a_supervisor_restart() -> None:
    plan = Plan(BatchPlan(8, 64, 1), eval_micro_batch=4, num_workers=1)
    resumed = Plan(BatchPlan(16, 64, 1), eval_micro_batch=16, num_workers=2).resumed(plan.as_dict())
    assert resumed == plan


# --- options -------------------------------------------------------------------------------------


def test_placeholder_options_are_checked_at_start() -> None:
    base = {"micro_batch": 8, "grad_accum": 2}
    with pytest.raises(UsageError, match="--num-workers"):
        RunConfig(command=("python", "t.py", "--workers", "{num_workers}"), **base)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"does not use \{eval_micro_batch\}"):
        RunConfig(command=("python", "t.py"), eval_micro_batch=4, **base)  # type: ignore[arg-type]
    config = RunConfig(command=("python", "t.py", "--eval-bs", "{eval_micro_batch}"), **base)  # type: ignore[arg-type]
    assert config.initial_eval_micro_batch == 8  # defaults to --micro-batch
    assert RunConfig(command=("python", "t.py"), **base).initial_eval_micro_batch is None  # type: ignore[arg-type]


# --- display -------------------------------------------------------------------------------------


def test_the_forecast_and_the_cause_are_shown_in_the_status_line_and_status_text() -> None:
    from oomguard.supervisor.ops.statusline import status_parts
    from oomguard.supervisor.record.status import format_status

    text = "cgroup limit in ~12 min at this rate (+39.0 MB/s)"
    assert (text, "yellow") in status_parts({"state": "running", "forecast": text}, None)
    doc = {"state": "running", "supervisor_alive": True, "reason": "r", "attempt": 2, "micro_batch": 16,
           "grad_accum": 4, "world_size": 1, "global_batch": 64, "worker_pid": 1, "checkpoint": None,
           "progress": None, "memory": None, "forecast": {"text": text},
           "failures": [{"attempt": 1, "kind": "host_oom", "micro_batch": 16, "exit_code": None, "signal": 9,
                         "evidence": "killed",
                         "cause": {"cause": "leak", "summary": "leak: worker RSS grew 4.0 MB/step"}}]}
    shown = format_status(doc)
    assert f"forecast:   {text}" in shown and "cause: leak: worker RSS grew 4.0 MB/step" in shown


def test_a_leak_is_notified_once_however_often_it_restarts_the_worker() -> None:
    """attach_notifications against a real HTTP receiver on 127.0.0.1."""
    import threading
    from pathlib import Path
    from types import SimpleNamespace

    from test_notify import Receiver

    from oomguard.supervisor.ops.hooks import attach_notifications
    from oomguard.supervisor.record.resilient import Degradations

    server = Receiver()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        sup = SimpleNamespace(config=SimpleNamespace(notify=(server.url + "/hook",)), run_dir=Path("/tmp/run"),
                              listeners=[], tickers=[], degradations=Degradations(print), plan=PLAN, attempt=3)
        close = attach_notifications(sup)  # type: ignore[arg-type]
        (listener,) = sup.listeners
        leak = {"action": "restart", "kind": "host_oom", "cause": "leak", "reason": "leak: worker RSS grew 4.0 MB/step",
                "micro_batch": 16, "grad_accum": 4, "evidence": "killed"}
        listener("planned_restart", {"reason": "planned restart after the next checkpoint: cgroup limit in ~5 s"})
        listener("decision", leak)
        listener("decision", leak)
        spike = "per-sample: a spike on a steady rise; the cgroup trend was 248 MiB below its 400 MiB limit"
        listener("attribution", {"cause": "per_sample", "summary": spike, "below_limit_bytes": 248 * MIB})
        listener("decision", {**leak, "cause": "per_sample", "micro_batch": 8})  # a per-sample OOM is still told
        server.wait_for(2)
        assert close is not None
        close()  # delivers whatever is queued: the requests below are all there ever were
        events = [body["event"] for _, body in server.requests]
        assert events == ["leak", "recovered"] and "memory leak" in server.requests[0][1]["title"], server.requests
        told = server.requests[1][1]  # the cause, with its figures, in the message and the details
        assert told["message"].endswith(f"\ncause: {spike}")
        assert told["details"]["cause"]["below_limit_bytes"] == 248 * MIB
    finally:
        server.shutdown()
        server.server_close()


def test_giving_up_tells_the_cause_of_the_last_failure_with_its_figures() -> None:
    import threading
    from pathlib import Path
    from types import SimpleNamespace

    from test_notify import Receiver

    from oomguard.supervisor.ops.hooks import attach_notifications
    from oomguard.supervisor.record.resilient import Degradations

    server = Receiver()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        sup = SimpleNamespace(config=SimpleNamespace(notify=(server.url + "/hook",)), run_dir=Path("/tmp/run"),
                              listeners=[], tickers=[], degradations=Degradations(print), plan=PLAN, attempt=5)
        close = attach_notifications(sup)  # type: ignore[arg-type]
        (listener,) = sup.listeners
        spike = "per-sample: a spike on a steady rise; the cgroup trend was 248 MiB below its 400 MiB limit"
        listener("attribution", {"cause": "per_sample", "summary": spike, "below_limit_bytes": 248 * MIB})
        reason = "out of memory even at the smallest micro-batch (1, --min-micro-batch 1)"
        listener("decision", {"action": "give_up", "kind": "host_oom", "cause": "per_sample", "reason": reason,
                              "micro_batch": 1, "grad_accum": 64, "evidence": "killed"})
        listener("state", {"from": "recovering", "to": "failed", "reason": reason})
        server.wait_for(1)
        assert close is not None
        close()
        (_, body), = server.requests
        assert body["message"] == f"{reason}\ncause: {spike}"
        assert body["details"]["cause"]["below_limit_bytes"] == 248 * MIB
    finally:
        server.shutdown()
        server.server_close()


# --- the loop's trend watch ------------------------------------------------------------------------


def _sample(t: float, rss: int, working_set: int, limit: int) -> object:
    from oomguard.supervisor.observe.sampler import CgroupMemory, MemorySample

    return MemorySample(t, t, 1, rss, (1,), 64 * 2**30, 32 * 2**30,
                        CgroupMemory("/cg", 1, working_set, working_set, limit, 0), None)


def test_the_watch_plans_a_restart_for_a_leak_but_not_for_page_cache() -> None:
    from oomguard.supervisor.run.trendwatch import TrendWatch

    limit = 800 * MB  # 760 MB at --soft-threshold 0.95: reached 8.5 s after the last sample
    leak, cache = TrendWatch(), TrendWatch()
    for watch in (leak, cache):
        for t in (0.0, 10.0):
            watch.checkpoint_seen(t)  # a checkpoint every 10 s
    for i in range(40):
        t = 10.0 + i * 0.5
        # 20 MB/s in both cgroups; only the leaking worker's own RSS rises with it
        leak.add(_sample(t, 100 * MB + i * 10 * MB, 200 * MB + i * 10 * MB, limit), i * 5, None, 0.95)  # type: ignore[arg-type]
        cache.add(_sample(t, 100 * MB, 200 * MB + i * 10 * MB, limit), i * 5, None, 0.95)  # type: ignore[arg-type]
    assert leak.forecast is not None and leak.forecast.move is Move.RESTART_AT_NEXT
    assert leak.forecast.budget == "cgroup" and leak.forecast.per_s == pytest.approx(20 * MB, rel=0.01)
    assert cache.forecast is not None and cache.forecast.move is Move.WATCH  # shown, not acted on
    assert leak.attribute(Evidence(), 16).cause is Cause.LEAK
    assert cache.attribute(Evidence(), 16).cause is Cause.PER_SAMPLE
