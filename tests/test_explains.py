"""Issue 23: a rise is a leak only when its trend explains the failure. Pure tests of the rule over
scripted and recorded sample series (tests/data/series/*.json, recorded from real runs in a 400 MiB
memory cgroup), with the reasons for its thresholds; the same line in the forecast and the report."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.attribution import Cause, Evidence, Limit, attribute
from oomguard.supervisor.decide.classify import FailureKind
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.sizing.trend import (
    MAX_JUMP_READINGS,
    NOISE_SIGMAS,
    TOLERANCE_FRACTION,
    Budget,
    Headroom,
    Reading,
    forecast,
    steady_rise,
)

MB = 10**6
MIB = 2**20
LIMIT = 400 * MIB
SERIES = Path(__file__).resolve().parent / "data" / "series"


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
    assert "250 MiB short of the 400 MiB limit (~500 steps at this rate" in found.summary
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
    assert "leak: worker RSS grew 4.2 MB/step" in found.summary and "counts as reaching it" in found.summary


def test_without_a_limit_to_measure_against_a_steady_line_stands_on_its_readings() -> None:
    """A planned restart has no failure to explain (the forecast already measured the line to the
    limit): a steady rise is a leak unless its last readings jump above it."""
    series = creep()
    assert attribute(series, Evidence(), 16).cause is Cause.LEAK
    jumped = then(series, 300 * MIB)
    found = attribute(jumped, Evidence(), 16)
    assert found.cause is Cause.PER_SAMPLE and "a spike on a steady rise" in found.summary


def test_a_leak_that_also_spikes_names_both_and_the_figures_pick_the_remedy() -> None:
    """1 MiB a step from 100 MiB: after 175 steps the line is at ~275 MiB, 125 MiB below the limit,
    when one step's 160 MiB spike kills. The leak added 165 MiB in the attempt, more than the 125 the
    spike needed: a fresh restart at the same size has room for the spike."""
    series = creep(n=18, every=1.0, steps_per_s=10, per_step=1 * MIB)
    found = attribute(series, Evidence(), 16, limit=cgroup(series, failed_at=series[-1].t + 0.5))
    assert found.cause is Cause.LEAK and found.also is Cause.PER_SAMPLE
    f = found.figures
    assert f["rise_bytes"] >= f["below_limit_bytes"] > f["tolerance_bytes"]
    assert found.summary.startswith("leak and a spike: worker RSS grew 1.0 MB/step")
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
    assert found.cause is Cause.EVALUATION and "short of the 400 MiB limit" in found.summary
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
        f"the cgroup trend line was at {trend.last / MIB:.0f} MiB, {(LIMIT - trend.last) / MIB:.0f} MiB short of the "
        f"400 MiB limit (~{(LIMIT - trend.last) / trend.per_step:.0f} steps at this rate; within 8 MiB counts as "
        "reaching it)")
    past = Headroom("GPU", 100 * MIB, trend, trend.t_last)
    assert past.reached and past.seconds == 0 and "MiB past the 100 MiB limit" in past.describe()
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
    from oomguard.supervisor.run.trendwatch import TrendWatch

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
    from oomguard.supervisor.run.trendwatch import TrendWatch

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
    from oomguard.supervisor.run.trendwatch import TrendWatch

    device = 80 * 2**30
    watch = TrendWatch()
    for i in range(30):
        own = 600 * MIB + i * 128 * MIB  # 64 MiB a step, 2 steps a reading: 4.2 GiB at the end
        gpu = GpuReading(0, 0, "GPU-0", "H100", device, own + 2 * 2**30, device - own - 2 * 2**30, 90, own, (1,))
        watch.add(MemorySample(i * 0.5, i * 0.5, 1, 2 * 2**30, (1,), 64 * 2**30, 32 * 2**30, None, None, (gpu,)),
                  i * 2, None, 0.95)
    capped = watch.attribute(Evidence(capacity=4 * 2**30), 16, kind=FailureKind.CUDA_OOM, failed_at=14.6)
    assert capped.cause is Cause.LEAK and capped.figures["budget"] == "process's GPU"
    assert capped.figures["limit_bytes"] == 4 * 2**30 and "GPU memory grew 67.1 MB/step" in capped.summary
    device_only = watch.attribute(Evidence(), 16, kind=FailureKind.CUDA_OOM, failed_at=14.6)
    assert device_only.figures["budget"] == "GPU" and device_only.figures["limit_bytes"] == device
    assert device_only.cause is Cause.PER_SAMPLE  # 74 GiB below the device's capacity: the line did not reach it
