"""The cause of a memory failure, the forecast and the remedy per cause: pure functions over
scripted sample series, traceback frames and histories."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from support import DATA

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.config import RunConfig
from oomguard.supervisor.decide.attribution import Attribution, Cause, Evidence, Limit, Plateau, attribute, step_peaks
from oomguard.supervisor.decide.classify import ExitFacts, FailureKind, classify
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.observe.allocator import AllocatorOom
from oomguard.supervisor.observe.output import OutputScanner, Phase, phase_of
from oomguard.supervisor.sizing.memmodel import Fit
from oomguard.supervisor.sizing.trend import (
    MAX_JUMP_READINGS,
    NOISE_SIGMAS,
    TOLERANCE_FRACTION,
    Budget,
    Headroom,
    Move,
    Reading,
    forecast,
    soonest,
    steady_rise,
)

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
    assert trend.describe("worker RSS") == "worker RSS rose steadily by 2.2 GiB in 58 s (about 3.8 MiB a step)"


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
    assert per.cause is Cause.PER_SAMPLE and "memory did not keep rising" in per.summary
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
        RunConfig.of(command=("python", "t.py", "--workers", "{num_workers}"), **base)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"does not use \{eval_micro_batch\}"):
        RunConfig.of(command=("python", "t.py"), eval_micro_batch=4, **base)  # type: ignore[arg-type]
    config = RunConfig.of(command=("python", "t.py", "--eval-bs", "{eval_micro_batch}"),
                          **base)  # type: ignore[arg-type]
    assert config.initial_eval_micro_batch == 8  # defaults to --micro-batch
    assert RunConfig.of(command=("python", "t.py"), **base).initial_eval_micro_batch is None  # type: ignore[arg-type]


# --- display -------------------------------------------------------------------------------------


def test_the_forecast_and_the_cause_are_shown_in_the_status_line_and_status_text() -> None:
    from oomguard.supervisor.ops.hooks import status_parts
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
    from types import SimpleNamespace

    from support_notify import Receiver

    from oomguard.supervisor.ops.hooks import attach_notifications
    from oomguard.supervisor.record.journal import Degradations

    server = Receiver()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        notify = SimpleNamespace(targets=(server.url + "/hook",))
        sup = SimpleNamespace(config=SimpleNamespace(notify=notify), run_dir=Path("/tmp/run"),
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
    from types import SimpleNamespace

    from support_notify import Receiver

    from oomguard.supervisor.ops.hooks import attach_notifications
    from oomguard.supervisor.record.journal import Degradations

    server = Receiver()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        notify = SimpleNamespace(targets=(server.url + "/hook",))
        sup = SimpleNamespace(config=SimpleNamespace(notify=notify), run_dir=Path("/tmp/run"),
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
    from oomguard.supervisor.run.attempt import TrendWatch

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


# --- merged from tests/test_explains.py ---------------------------------------------------------------------
# Issue 23: a rise is a leak only when its trend explains the failure. Pure tests of the rule over
# scripted and recorded sample series (tests/data/series/*.json, recorded from real runs in a 400 MiB
# memory cgroup), with the reasons for its thresholds; the same line in the forecast and the report.


LIMIT = 400 * MIB
SERIES = DATA / "series"


def creep(n: int = 30, every: float = 1.0, steps_per_s: float = 3.4, base: int = 100 * MIB,
          per_step: float = 0.5 * MIB, noise: float = 0.0, gauss: bool = False, seed: int = 1) -> list[Reading]:
    """Samples every ``every`` s of a worker that keeps ``per_step`` bytes a step, at a steady rate."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        t = i * every
        step = int(t * steps_per_s)
        jitter = rnd.gauss(0, noise) if gauss else rnd.uniform(-noise, noise)
        out.append(Reading(t, int(base + step * per_step + jitter), step))
    return out


def then(series: list[Reading], *used: int, every: float = 1.0) -> list[Reading]:
    """``series`` followed by readings of ``used`` bytes, one every ``every`` s, the steps going on."""
    last = series[-1]
    rate = (last.step or 0) / last.t if last.t else 0.0
    return [*series, *(Reading(last.t + (i + 1) * every, u, int((last.t + (i + 1) * every) * rate))
                       for i, u in enumerate(used))]


def cgroup(series: list[Reading], failed_at: float | None = None) -> Limit:
    return Limit("cgroup", LIMIT, series, failed_at)


def why(attribution: object) -> str:
    return json.dumps(attribution.as_dict())  # type: ignore[attr-defined]


# --- the rule --------------------------------------------------------------------------------------


def test_the_issue_a_perfect_creep_far_below_the_limit_is_no_leak() -> None:
    """0.5 MiB a step, R² 1.00 over 29 samples, and the kernel killed the worker ~0.6 s after the last
    reading, with the line ~245 MiB below the limit: something jumped above it between two readings."""
    series = creep()
    own = steady_rise(series)
    assert own is not None and own.steady() and own.r2 > 0.999  # the old rule called this a leak
    found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=series[-1].t + 0.6))
    assert found.cause is Cause.PER_SAMPLE and found.also is None
    assert "leak" not in why(found).lower()
    f = found.figures
    assert f["below_limit_bytes"] == pytest.approx(LIMIT - (100 * MIB + 0.5 * MIB * 3.4 * 29.6), rel=0.02)
    assert f["below_limit_bytes"] > 200 * MIB and f["tolerance_bytes"] == int(TOLERANCE_FRACTION * LIMIT)
    assert f["rise_bytes"] < f["below_limit_bytes"] and f["steps_to_limit"] == pytest.approx(500, rel=0.02)
    # "~500 steps at this rate" stays in the data (steps_to_limit, above), not the sentence
    assert "when it failed, 249.9 MiB below the cgroup limit of 400.0 MiB" in found.summary
    assert "steps" not in found.summary
    assert "the jump, not the rise, reached the limit" in found.summary
    d = decide(Failure(1, FailureKind.HOST_OOM, 16, "killed", attribution=found), [], Plan(BatchPlan(16, 64, 1)),
               PolicyConfig())
    assert d.action is Action.RESTART and d.plan.batch.micro_batch == 8 and d.plan.batch.grad_accum == 8


def test_a_spike_that_a_reading_caught_is_a_jump_above_the_trend_not_part_of_it() -> None:
    """A slow allocation near a cgroup's limit (reclaim) is caught by several readings: each is
    compared with the line of the readings before the jump, so none of them bends the line."""
    series = then(creep(), 160 * MIB, 260 * MIB, 350 * MIB, every=0.5)
    trend = steady_rise(series)
    assert trend is not None and trend.steady() and trend.r2 > 0.999
    assert trend.jump is not None and trend.jump.readings == 3 and trend.jump.above > 190 * MIB
    found = attribute(series, Evidence(), 16, limit=cgroup(series))
    assert found.cause is Cause.PER_SAMPLE and found.figures["jump_bytes"] > 190 * MIB
    assert "memory jumped" in found.summary and "leak" not in why(found).lower()


def test_a_leak_whose_line_reaches_the_limit_is_a_leak() -> None:
    # 4 MiB a step, 10 steps a second: 40 MiB/s from 100 MiB to the limit, ±1 MiB of noise.
    series = creep(n=16, every=0.5, steps_per_s=10, per_step=4 * MIB, noise=1 * MIB)
    found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=series[-1].t + 0.2))
    assert found.cause is Cause.LEAK and found.also is None
    assert found.figures["below_limit_bytes"] <= found.figures["tolerance_bytes"]
    assert "leak: worker RSS rose steadily by 279.7 MiB in 7 s (about 4.0 MiB a step)" in found.summary
    assert "had passed the cgroup limit of 400.0 MiB when it failed" in found.summary


def test_without_a_limit_to_measure_against_a_steady_line_stands_on_its_readings() -> None:
    """A planned restart has no failure to explain (the forecast already measured the line to the
    limit): a steady rise is a leak unless its last readings jump above it."""
    series = creep()
    assert attribute(series, Evidence(), 16).cause is Cause.LEAK
    jumped = then(series, 300 * MIB)
    found = attribute(jumped, Evidence(), 16)
    assert found.cause is Cause.PER_SAMPLE and "rose steadily by" in found.summary and ", then jumped" in found.summary


def test_a_leak_that_also_spikes_names_both_and_the_figures_pick_the_remedy() -> None:
    """1 MiB a step from 100 MiB: after 175 steps the line is at ~275 MiB, 125 MiB below the limit,
    when one step's 160 MiB spike kills. The leak added 165 MiB in the attempt, more than the 125 the
    spike needed: a fresh restart at the same size has room for the spike."""
    series = creep(n=18, every=1.0, steps_per_s=10, per_step=1 * MIB)
    found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=series[-1].t + 0.5))
    assert found.cause is Cause.LEAK and found.also is Cause.PER_SAMPLE
    f = found.figures
    assert f["rise_bytes"] >= f["below_limit_bytes"] > f["tolerance_bytes"]
    assert found.summary.startswith("leak and a spike: worker RSS rose steadily by 160.0 MiB in 16 s "
                                    "(about 1.0 MiB a step)")
    assert "a fresh restart at the same size has room for the spike" in found.summary
    assert found.as_dict()["also"] == "per_sample"
    d = decide(Failure(1, FailureKind.HOST_OOM, 16, "killed", new_checkpoint=True, attribution=found), [],
               Plan(BatchPlan(16, 64, 1)), PolicyConfig())
    assert d.action is Action.RESTART and d.plan.batch.micro_batch == 16
    assert "the leak's growth, not the batch, used the room" in d.reason
    in_eval = attribute(series, Evidence(frames=("main", "evaluate")), 16, limit=cgroup(series))
    assert in_eval.cause is Cause.LEAK and in_eval.also is Cause.EVALUATION
    assert "it failed in evaluation" in in_eval.summary


def test_when_the_leak_added_less_than_the_spike_needed_the_batch_shrinks() -> None:
    """The same leak, killed by a spike at step 60: the line had added 60 MiB and was 240 MiB below."""
    series = creep(n=7, every=1.0, steps_per_s=10, per_step=1 * MIB)
    found = attribute(series, Evidence(), 16, limit=cgroup(series))
    assert found.cause is Cause.PER_SAMPLE and found.figures["rise_bytes"] < found.figures["below_limit_bytes"]


def test_a_phase_named_in_the_output_is_the_spike_on_a_creep() -> None:
    series = creep()
    found = attribute(series, Evidence(tail=("Evaluating at step 100",)), 16, limit=cgroup(series))
    assert found.cause is Cause.EVALUATION and "below the cgroup limit of 400.0 MiB" in found.summary
    assert "leak" not in why(found).lower()


# --- the thresholds and their reasons --------------------------------------------------------------


def test_the_tolerance_is_three_sigma_of_the_readings_noise_with_a_floor() -> None:
    """3 σ: a sawtooth of per-step allocations peaks ~1.7 σ above its line, and 99.7 % of Gaussian
    scatter lies within 3 σ; the floor (2 % of the limit) is what no reading sees (kernel memory
    charged to the cgroup, the moment between the last reading and the kill)."""
    quiet = steady_rise(creep(n=16, every=0.5, steps_per_s=10, per_step=4 * MIB))
    noisy = steady_rise(creep(n=16, every=0.5, steps_per_s=10, per_step=4 * MIB, noise=12 * MIB))
    assert quiet is not None and noisy is not None
    assert quiet.tolerance(LIMIT) == TOLERANCE_FRACTION * LIMIT  # σ ~ 0: the floor
    assert noisy.tolerance(LIMIT) == pytest.approx(NOISE_SIGMAS * noisy.noise) and noisy.noise > 5 * MIB


def test_noise_does_not_hide_a_leak_and_a_chance_jump_keeps_its_remedy() -> None:
    """A noisy leak (uniform ±12 MiB about a 40 MiB/s line; σ ~7 MiB) killed at the limit, 40 times:
    its line reaches the limit within 3 σ every time. A last reading that happens to lie 3 σ above
    the line of the 14 before it (σ estimated low by chance) is read as a jump, and the figures
    still restart at the same size: the leak's rise (hundreds of MiB) covers the jump many times."""
    jumps = 0
    for seed in range(40):
        series = creep(n=16, every=0.5, steps_per_s=10, per_step=4 * MIB, noise=12 * MIB, seed=seed)
        trend = steady_rise(series)
        assert trend is not None and trend.steady()
        jumps += trend.jump is not None
        found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=series[-1].t + 0.2))
        assert found.cause is Cause.LEAK, found.summary
        assert found.figures["below_limit_bytes"] <= found.figures["tolerance_bytes"]
    assert jumps <= 2


def test_gaussian_noise_makes_a_jump_of_a_reading_rarely() -> None:
    """With Gaussian scatter a last reading is more than 3 σ above the line 0.13 % of the time."""
    jumps = 0
    for seed in range(300):
        trend = steady_rise(creep(n=30, per_step=2 * MIB, noise=3 * MIB, gauss=True, seed=seed))
        assert trend is not None
        jumps += trend.jump is not None
    assert jumps <= 3


def test_a_jump_is_the_last_seconds_not_a_new_level() -> None:
    """Past half the readings, or past MAX_JUMP_READINGS of them, memory moved to a new level: the
    line is fitted through all of it (and is no steady rise)."""
    flat = [Reading(float(i), 100 * MIB, i * 3) for i in range(20)]
    level = then(flat, *[300 * MIB] * 30)
    trend = steady_rise(level)
    assert trend is not None and trend.jump is None and not trend.steady()
    long_run = then(creep(n=100), *[400 * MIB] * (MAX_JUMP_READINGS + 1))
    trend = steady_rise(long_run)
    assert trend is not None and trend.jump is None
    short_run = then(creep(n=100), *[400 * MIB] * MAX_JUMP_READINGS)
    trend = steady_rise(short_run)
    assert trend is not None and trend.jump is not None and trend.jump.readings == MAX_JUMP_READINGS


# --- one model for the forecast and the report ------------------------------------------------------


def test_the_forecast_and_the_attribution_measure_the_same_line() -> None:
    series = creep()
    now = series[-1].t
    budget = Budget("cgroup", series[-1].used, LIMIT, LIMIT)
    shown = forecast(series, budget, None, None)
    found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=now))
    assert shown is not None and shown.measured
    assert found.figures["seconds_to_limit"] == pytest.approx(shown.seconds_to_limit, abs=0.1)
    trend = steady_rise(series)
    assert trend is not None
    room = Headroom("cgroup", LIMIT, trend, now)
    assert shown.seconds_to_limit == pytest.approx(room.seconds)
    # What status showed 10 s before the failure, carried forward, is where the report puts the line.
    earlier = [r for r in series if r.t <= now - 10]
    before = forecast(earlier, Budget("cgroup", earlier[-1].used, LIMIT), None, None)
    assert before is not None
    assert before.seconds_to_limit - 10 == pytest.approx(found.figures["seconds_to_limit"], rel=0.02)


def test_headroom_in_words() -> None:
    trend = steady_rise(creep())
    assert trend is not None
    assert Headroom("cgroup", LIMIT, trend, trend.t_last).describe() == (
        f"its steady rise was at about {trend.last / MIB:.1f} MiB when it failed, {(LIMIT - trend.last) / MIB:.1f} MiB "
        "below the cgroup limit of 400.0 MiB")
    past = Headroom("GPU", 100 * MIB, trend, trend.t_last)
    assert past.reached and past.seconds == 0 and "had passed the GPU limit of 100.0 MiB" in past.describe()
    flat = steady_rise([Reading(float(i), 100 * MIB) for i in range(20)])
    assert flat is not None and math.isinf(Headroom("host", LIMIT, flat, 19.0).seconds)


# --- recorded series --------------------------------------------------------------------------------


def recorded(name: str) -> tuple[list[Reading], Limit, dict[str, object]]:
    doc = json.loads((SERIES / f"{name}.json").read_text())
    own = [Reading(*r) for r in doc["own"]]
    counted = Limit(doc["budget"], doc["limit_bytes"], [Reading(*r) for r in doc["counted"]], doc["failed_at"])
    return own, counted, doc


@pytest.mark.parametrize("name,cause,also", [
    ("creep_spike_unseen", Cause.PER_SAMPLE, None),  # the issue as it happened: no reading saw the spike
    ("creep_spike_seen", Cause.PER_SAMPLE, None),  # a reading caught the spike as the cgroup filled
    ("leak_kill", Cause.LEAK, None),  # a 4 MiB/step leak killed by the kernel, no checkpoints
    ("leak_spike", Cause.LEAK, Cause.PER_SAMPLE),  # a 1 MiB/step leak and one step's spike
])
def test_recorded_series(name: str, cause: Cause, also: Cause | None) -> None:
    own, limit, doc = recorded(name)
    found = attribute(own, Evidence(), 16, limit=limit)
    assert (found.cause, found.also) == (cause, also), found.summary
    assert found.figures["budget"] == "cgroup" and found.figures["limit_bytes"] == LIMIT
    if cause is Cause.PER_SAMPLE:
        assert "leak" not in why(found).lower()
        assert found.figures["below_limit_bytes"] > 100 * MIB


# --- the loop's trend watch: which limit a failure hit ----------------------------------------------


def sample(t: float, rss: int, counted: int | None = None, limit: int | None = None,
           available: int = 32 * 2**30) -> object:
    from oomguard.supervisor.observe.sampler import CgroupMemory, MemorySample

    cg = None if limit is None else CgroupMemory("/cg", 1, rss, rss, limit, 0, counted)
    return MemorySample(t, t, 1, rss, (1,), 64 * 2**30, available, cg, None)


def test_the_watch_measures_a_failure_against_the_limit_its_kind_hit() -> None:
    """A host OOM in a cgroup: the cgroup's limit, against the working set of the cgroup that sets
    it (oomguard itself included: 40 MiB here). No kind (a planned restart): nothing to explain."""
    from oomguard.supervisor.run.attempt import TrendWatch

    watch = TrendWatch()
    for i in range(40):  # 5 steps and 5 MiB a reading: counted memory from 140 to 335 MiB, 65 MiB below the limit
        rss = 100 * MIB + i * 5 * MIB
        watch.add(sample(i * 0.5, rss, rss + 40 * MIB, LIMIT), i * 5, None, 0.95)  # type: ignore[arg-type]
    killed = watch.attribute(Evidence(), 16, kind=FailureKind.HOST_OOM, failed_at=19.5)
    assert killed.figures["budget"] == "cgroup" and killed.figures["limit_bytes"] == LIMIT
    assert killed.figures["trend_at_failure_bytes"] == pytest.approx(100 * MIB + 39 * 5 * MIB + 40 * MIB, abs=MIB)
    assert (killed.cause, killed.also) == (Cause.LEAK, Cause.PER_SAMPLE)  # 190 MiB of rise, 65 MiB below
    planned = watch.attribute(Evidence(), 16)
    assert planned.cause is Cause.LEAK and "budget" not in planned.figures
    gpu = watch.attribute(Evidence(), 16, kind=FailureKind.CUDA_OOM)  # no GPU readings: no limit to measure
    assert gpu.cause is Cause.LEAK and "budget" not in gpu.figures


def test_without_a_cgroup_limit_a_host_oom_is_measured_against_the_machine() -> None:
    from oomguard.supervisor.run.attempt import TrendWatch

    watch = TrendWatch()
    total = 64 * 2**30
    for i in range(40):
        rss = 100 * MIB + i * 5 * MIB
        watch.add(sample(i * 0.5, rss, available=total - 60 * 2**30 - rss), i * 5, None, 0.95)  # type: ignore[arg-type]
    found = watch.attribute(Evidence(), 16, kind=FailureKind.HOST_OOM, failed_at=19.5)
    assert found.figures["budget"] == "host" and found.figures["limit_bytes"] == total
    assert found.cause is Cause.PER_SAMPLE  # 3.7 GiB below the machine's memory: the worker's rise did not fill it


def test_a_cuda_leak_under_a_memory_fraction_is_measured_against_the_cap_its_oom_message_names() -> None:
    """NVML sees the device (80 GiB), not torch.cuda.set_per_process_memory_fraction's cap (4 GiB
    here): the OOM message's "4.00 GiB allowed" is the limit that applied, and the process's own
    GPU memory (its CUDA context included, so a little past the cap) is measured against it."""
    from oomguard.supervisor.observe.gpu import GpuReading
    from oomguard.supervisor.observe.sampler import MemorySample
    from oomguard.supervisor.run.attempt import TrendWatch

    device = 80 * 2**30
    watch = TrendWatch()
    for i in range(30):
        own = 600 * MIB + i * 128 * MIB  # 64 MiB a step, 2 steps a reading: 4.2 GiB at the end
        gpu = GpuReading(0, 0, "GPU-0", "H100", device, own + 2 * 2**30, device - own - 2 * 2**30, 90, own, (1,))
        watch.add(MemorySample(i * 0.5, i * 0.5, 1, 2 * 2**30, (1,), 64 * 2**30, 32 * 2**30, None, None, (gpu,)),
                  i * 2, None, 0.95)
    capped = watch.attribute(Evidence(capacity=4 * 2**30), 16, kind=FailureKind.CUDA_OOM, failed_at=14.6)
    assert capped.cause is Cause.LEAK and capped.figures["budget"] == "process's GPU"
    assert capped.figures["limit_bytes"] == 4 * 2**30 and "(about 64.0 MiB a step)" in capped.summary
    device_only = watch.attribute(Evidence(), 16, kind=FailureKind.CUDA_OOM, failed_at=14.6)
    assert device_only.figures["budget"] == "GPU" and device_only.figures["limit_bytes"] == device
    assert device_only.cause is Cause.PER_SAMPLE  # 74 GiB below the device's capacity: the line did not reach it


# --- merged from tests/test_attribution_pins.py -------------------------------------------------------------
# The cause line and its figures, word for word: what the journal, status --json, the report and
# the notification show of a memory failure (docs/mutation.md: the survivors these pin).
#
# Scripted series from tests/unit/supervisor/decide/test_attribution.py against a 400 MiB cgroup; every figure below was
# checked by hand against its series (a 1 MiB-a-step creep at 10 steps a second, a noisy one, a
# plateau), so a change in any rounding, key or clause shows here.


CREEP = creep(n=18, every=1.0, steps_per_s=10, per_step=1 * MIB)  # 100 MiB + 1 MiB a step, 10 steps a second
GIB = 2**30
SHORT = creep(n=7, every=1.0, steps_per_s=10, per_step=1 * MIB)  # the same creep, failed after 60 steps
TREND = {"bytes_per_s": 10485760, "bytes_per_step": 1048576, "r2": 1.0, "span_s": 16.0, "samples": 17, "steps": 160}
SHORT_TREND = {**TREND, "samples": 6, "span_s": 5.0, "steps": 50}
SHORT_ROOM = {"budget": "cgroup", "limit_bytes": LIMIT, "trend_at_failure_bytes": 160 * MIB,
              "below_limit_bytes": 240 * MIB, "tolerance_bytes": 8 * MIB, "noise_bytes": 0, "rise_bytes": 50 * MIB,
              "seconds_to_limit": 24.0, "steps_to_limit": 240, "jump_bytes": None}
SHORT_ROOM_WORDS = ("its steady rise was at about 160.0 MiB when it failed, 240.0 MiB below the cgroup limit of "
                    "400.0 MiB, so the memory that reached the limit came between two readings")


def test_a_spike_on_a_noisy_creep_is_told_with_every_figure_rounded_as_shown() -> None:
    """Readings every 0.73 s with 3 MiB of noise, then one 300 MiB reading: the jump, not the
    line, reached the limit. No failure time is known, so the failure is at the last reading."""
    series = then(creep(n=18, every=0.73, steps_per_s=10, per_step=1 * MIB, noise=3 * MIB, seed=3), 300 * MIB,
                  every=0.73)
    found = attribute(series, Evidence(), 16, limit=cgroup(series))
    assert found.as_dict() == {
        "cause": "per_sample",
        "summary": "micro-batch 16 needed at least 300.0 MiB (the highest worker RSS reading before it failed: a "
                   "lower bound); worker RSS rose steadily by 118.3 MiB in 12 s (about 1.0 MiB a step), then jumped; "
                   "its steady rise was at about 231.8 MiB when it failed, 168.2 MiB below the cgroup limit of "
                   "400.0 MiB, and memory jumped 68.2 MiB above it; the rise added only 125.6 MiB in this attempt, "
                   "less than the 168.2 MiB the jump needed on top of it, so the jump, not the rise, reached the "
                   "limit; no evaluation or checkpoint step was seen, so the batch is taken as the cause; only "
                   "micro-batch 16 measured so far",
        "bytes_per_s": 10616167, "bytes_per_step": 1061239, "r2": 0.998, "samples": 17, "span_s": 11.7,
        "steps": 117, "budget": "cgroup", "limit_bytes": LIMIT, "trend_at_failure_bytes": 243056234,
        "below_limit_bytes": 176374166, "tolerance_bytes": 8 * MIB, "noise_bytes": 2017789,
        "rise_bytes": 131746629, "seconds_to_limit": 16.6, "steps_to_limit": 166, "jump_bytes": 71516564,
        "plateau_bytes": 300 * MIB, "plateau_censored": True}


def test_a_leak_that_added_the_room_the_jump_needed_names_the_jump_and_the_phase() -> None:
    series = then(CREEP, 300 * MIB)
    found = attribute(series, Evidence(frames=("main", "evaluate")), 16, limit=cgroup(series))
    assert found.cause is Cause.LEAK and found.also is Cause.EVALUATION
    assert found.summary == (
        "leak and a spike: worker RSS rose steadily by 160.0 MiB in 16 s (about 1.0 MiB a step) while training at "
        "micro-batch 16; its steady rise was at about 280.0 MiB when it failed, 120.0 MiB below the cgroup limit of "
        "400.0 MiB, and memory jumped above that rise (a reading saw 20.0 MiB above it); it failed in evaluation "
        "(traceback through evaluate()); the leak added 170.0 MiB in this attempt, at least the 120.0 MiB the jump "
        "needed on top of it, so a fresh restart at the same size has room for the spike")
    assert found.figures == {**TREND, "budget": "cgroup", "limit_bytes": LIMIT, "trend_at_failure_bytes": 280 * MIB,
                             "below_limit_bytes": 120 * MIB, "tolerance_bytes": 8 * MIB, "noise_bytes": 0,
                             "rise_bytes": 170 * MIB, "seconds_to_limit": 12.0, "steps_to_limit": 120,
                             "jump_bytes": 20 * MIB}
    assert found.as_dict()["also"] == "evaluation"


def test_a_leak_and_a_spike_no_reading_saw_in_no_phase() -> None:
    found = attribute(CREEP, Evidence(), 16, limit=cgroup(CREEP, failed_at=CREEP[-1].t + 0.5))
    assert found.cause is Cause.LEAK and found.also is Cause.PER_SAMPLE
    assert found.summary == (
        "leak and a spike: worker RSS rose steadily by 160.0 MiB in 16 s (about 1.0 MiB a step) while training at "
        "micro-batch 16; its steady rise was at about 275.0 MiB when it failed, 125.0 MiB below the cgroup limit of "
        "400.0 MiB, and memory jumped above that rise; the leak added 165.0 MiB in this attempt, at least the "
        "125.0 MiB the jump needed on top of it, so a fresh restart at the same size has room for the spike")
    assert found.figures["seconds_to_limit"] == 12.5 and found.figures["jump_bytes"] is None


def test_a_dead_dataloader_worker_is_quoted_without_its_full_stop_beside_the_room() -> None:
    found = attribute(SHORT, Evidence(dataloader=" DataLoader worker (pid 12) is killed by signal: Killed. "), 16,
                      limit=cgroup(SHORT))
    line = "DataLoader worker (pid 12) is killed by signal: Killed"
    assert found.as_dict() == {"cause": "data_loader",
                               "summary": f"a DataLoader worker died ({line}); {SHORT_ROOM_WORDS}",
                               **SHORT_TREND, **SHORT_ROOM, "evidence": line}


def test_a_phase_spike_keeps_its_evidence_and_says_the_rise_was_too_small() -> None:
    found = attribute(SHORT, Evidence(tail=("Saving model checkpoint to out",)), 16, limit=cgroup(SHORT))
    assert found.as_dict() == {
        "cause": "checkpoint_saving",
        "summary": f"memory ran out during checkpoint saving (last output: Saving model checkpoint to out); "
                   f"{SHORT_ROOM_WORDS}; the rise added only 50.0 MiB in this attempt, less than the 240.0 MiB the "
                   "jump needed on top of it, so the jump, not the rise, reached the limit",
        **SHORT_TREND, **SHORT_ROOM, "evidence": "last output: Saving model checkpoint to out"}


def test_without_a_limit_the_memory_named_and_the_micro_batch_are_in_the_line() -> None:
    assert attribute(creep(), Evidence(), 16, "GPU memory").summary == (
        "leak: GPU memory rose steadily by 47.6 MiB in 28 s (about 512.0 KiB a step) while training at micro-batch 16")
    found = attribute(then(creep(), 300 * MIB), Evidence(), 16, "GPU memory")
    assert found.summary == (
        "micro-batch 16 needed at least 300.0 MiB (the highest GPU memory reading before it failed: a lower bound); "
        "GPU memory rose steadily by 47.6 MiB in 28 s (about 512.0 KiB a step), then jumped; no evaluation or "
        "checkpoint step was seen, so the batch is taken as the cause; only micro-batch 16 measured so far")


def test_too_few_readings_or_no_rise_say_so_with_the_plateau() -> None:
    assert attribute(SHORT[:3], Evidence(), 16).summary == (
        "micro-batch 16 needed at least 120.0 MiB (the highest worker RSS reading before it failed: a lower bound); "
        "too few readings to tell whether memory was rising; no evaluation or checkpoint step was seen, so the batch "
        "is taken as the cause; only micro-batch 16 measured so far")
    level = attribute(plateau_series(), Evidence(), 16, "GPU memory", failed=False)
    assert level.summary == ("micro-batch 16 used 767.7 MiB at its highest GPU memory reading; memory did not keep "
                             "rising after warm-up; no evaluation or checkpoint step was seen, so the batch is taken "
                             "as the cause; only micro-batch 16 measured so far")
    assert (level.figures["bytes_per_s"], level.figures["r2"]) == (1054369, 0.095)  # the statistics stay in the data
    assert level.figures["plateau_bytes"] == 804957035 and level.figures["plateau_censored"] is False
    model = attribute(plateau_series(), Evidence(), 16, "GPU memory", model=Fit(200 * MIB, 3.25 * MIB, 2))
    assert model.summary.endswith("; the memory model measured 3.2 MiB a sample: memory follows the micro-batch")
    assert model.figures["per_sample_bytes"] == 3407872


def measured(*plateaus: tuple[int, int]) -> list[Plateau]:
    return [Plateau(micro, size, False) for micro, size in plateaus]


def test_memory_follows_only_beyond_the_margin() -> None:
    """5 % more at twice the batch is jitter, not memory following the batch."""
    smallest = 400 * MIB
    at_margin = int(smallest * 1.05)
    assert at_margin == smallest * 1.05  # exactly on the margin: not above it
    found = attribute((), Evidence(), 32, earlier=measured((64, at_margin), (32, smallest)), failed=False)
    assert found.figures["follows"] is False and found.figures["plateaus"] == {"64": at_margin, "32": smallest}
    assert attribute((), Evidence(), 32, earlier=measured((64, at_margin + 1), (32, smallest)),
                     failed=False).figures["follows"] is True


def test_level_plateaus_stay_level_measured_from_the_largest_to_the_smallest_batch() -> None:
    found = attribute((), Evidence(), 32, earlier=measured((128, 400 * MIB), (64, 300 * MIB), (32, 400 * MIB)),
                      failed=False)
    assert found.figures["follows"] is False
    assert found.summary.endswith("but memory does not follow the micro-batch: its highest readings stayed level as "
                                  "the micro-batch shrank (400.0 MiB at 128, 300.0 MiB at 64, 400.0 MiB at 32)")
    assert found.figures["plateaus"] == {"128": 400 * MIB, "64": 300 * MIB, "32": 400 * MIB}


def test_a_jump_larger_than_the_room_left_needs_more_than_the_leak_gave_back() -> None:
    """The line was 140 MiB below the limit and had risen 150 MiB, but a reading saw memory 220 MiB
    above it: the jump needed 220 MiB, more than a fresh restart gives back, so the batch shrinks."""
    series = then(SHORT, 390 * MIB)
    found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=16.0))
    f = found.figures
    assert (f["rise_bytes"], f["below_limit_bytes"], f["jump_bytes"]) == (150 * MIB, 140 * MIB, 220 * MIB)
    assert found.cause is Cause.PER_SAMPLE and found.also is None
    assert ("; the rise added only 150.0 MiB in this attempt, less than the 220.0 MiB the jump needed on top of it, "
            "so the jump, not the rise, reached the limit") in found.summary


def test_a_leak_that_gave_back_exactly_what_the_jump_needed_is_enough() -> None:
    series = then(SHORT, 390 * MIB)
    at_equal = 22.999999999999996  # found by bisection: the line's rise equals the jump's height here
    found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=at_equal))
    assert found.figures["rise_bytes"] == found.figures["jump_bytes"] == 220 * MIB
    assert found.cause is Cause.LEAK and found.also is Cause.PER_SAMPLE


def test_the_allocators_figures_and_the_slope_of_the_other_sizes_peaks() -> None:
    """The probe caught the OOM at 256 under a 0.9 memory fraction of an 80 GiB device; its step
    peaks measured 31 GiB at 128 and 16 GiB at 64 (15 GiB for 64 samples: 240 MiB each). The peak
    at the failing size itself and an empty one (0) measure nothing."""
    alloc = AllocatorOom("cuda:0", 1 * GIB, 70 * GIB, 74 * GIB, 1 * GIB, 80 * GIB, 0.9, 120, None)
    peaks = {256: 60 * GIB, 128: 31 * GIB, 64: 16 * GIB, 32: 0}
    found = attribute((), Evidence(allocator=alloc, step_peaks=peaks), 256, "GPU memory")
    assert found.as_dict() == {
        "cause": "per_sample",
        "summary": "micro-batch 256 needed at least 71.0 GiB: it asked for 1.0 GiB more with 70.0 GiB allocated; "
                   "the limit was 72.0 GiB (90% of the device); 4.0 GiB more was reserved but unallocated; about "
                   "240.0 MiB a sample, measured at 128 and 64",
        "source": "allocator", "requested_bytes": 1 * GIB, "allocated_bytes": 70 * GIB, "reserved_bytes": 74 * GIB,
        "limit_bytes": 72 * GIB, "fraction": 0.9, "per_sample_bytes": 240 * MIB, "measured_at": [128, 64]}


def test_the_allocators_own_micro_batch_wins_and_missing_figures_are_left_out() -> None:
    bare = AllocatorOom("cuda:0", None, None, None, None, None, None, None, 512)
    found = attribute((), Evidence(allocator=bare, step_peaks={512: 90 * GIB, 256: 20 * GIB}), 128, "GPU memory")
    assert found.summary == "an allocation failed at micro-batch 512; at most 80.0 MiB a sample, measured at 256"
    unbounded = AllocatorOom("cuda:0", 2 * GIB, 70 * GIB, 70 * GIB, None, None, None, None, None)
    assert attribute((), Evidence(allocator=unbounded), 64, "GPU memory").summary == (
        "micro-batch 64 needed at least 72.0 GiB: it asked for 2.0 GiB more with 70.0 GiB allocated")


def test_readings_that_saw_nothing_are_named_as_such() -> None:
    found = attribute([Reading(float(i), 0, i) for i in range(5)], Evidence(), 16, "GPU memory")
    assert found.as_dict() == {
        "cause": "per_sample", "unseen": "GPU memory",
        "summary": "micro-batch 16 ran out of memory; too few readings to tell whether memory was rising; the GPU "
                   "memory readings saw none of its memory (all 0); no evaluation or checkpoint step was seen, so "
                   "the batch is taken as the cause; only micro-batch 16 measured so far"}


@pytest.mark.parametrize(("this_failed", "earlier_failed", "bounds"), [
    (True, False, "400.0 MiB at 64, at least 300.0 MiB at 32"),
    (False, True, "at least 400.0 MiB at 64, 300.0 MiB at 32"),
])
def test_each_lower_bound_is_marked_and_only_it(this_failed: bool, earlier_failed: bool, bounds: str) -> None:
    found = attribute([Reading(float(i), 300 * MIB, i) for i in range(3)], Evidence(), 32,
                      earlier=[Plateau(64, 400 * MIB, earlier_failed)], failed=this_failed)
    assert found.summary.endswith(f"; the readings before a memory failure are lower bounds ({bounds}), so they "
                                  "cannot tell how memory scales with the micro-batch")
    assert found.figures["follows"] is None and found.figures["plateaus"] == {"64": 400 * MIB, "32": 300 * MIB}


def test_the_peak_of_each_size_is_its_highest_over_the_attempts() -> None:
    rows = [{"micro_batch": 32, "peak_allocated": 4 * GIB}, {"micro_batch": 16, "peak_allocated": 1 * GIB},
            {"micro_batch": 32, "peak_allocated": 3 * GIB}, {"micro_batch": 8}]
    assert step_peaks(rows) == {32: 4 * GIB, 16: 1 * GIB}


def test_memory_that_falls_never_reaches_the_limit_in_seconds_or_steps() -> None:
    """Freed memory (0.5 MiB a step less): no time or step count to the limit, null in the JSON."""
    falling = creep(n=20, every=1.0, steps_per_s=10, base=300 * MIB, per_step=-0.5 * MIB)
    found = attribute(falling, Evidence(), 16, limit=cgroup(falling))
    assert found.figures["seconds_to_limit"] is None and found.figures["steps_to_limit"] is None
    assert "was at about 205.0 MiB when it failed, 195.0 MiB below the cgroup limit of 400.0 MiB" in found.summary
