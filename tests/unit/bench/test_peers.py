"""bench/peers.py: how the records become the table, and the harness end to end in a tiny mode.

The record tests feed ``trace``/``summarize`` the event sequences each kind of contender writes
(an OOM in the middle of an accumulation, Lightning's closure-style step, a restart in a new
process). The end-to-end test runs the real harness with ``oomguard run`` (restarts) under a real
RLIMIT_AS cap (a micro-batch of 16 does not fit in 100 MB, 8 does) and checks the JSON it writes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from oomguard.supervisor.record.journal import Journal

ROOT = Path(__file__).resolve().parents[3]


def _load_peers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


peers = _load_peers()


def rec(ev: str, t: float, pid: int = 1, **fields: Any) -> dict[str, Any]:
    return {"ev": ev, "t": t, "pid": pid, **fields}


def step(t: float, sizes: list[int], pid: int = 1) -> list[dict[str, Any]]:
    """One optimizer step of several micro-batches, the first one finding the gradients cleared."""
    out = []
    for i, n in enumerate(sizes):
        out += [rec("fwd", t, pid, n=n), rec("bwd", t + 0.01, pid, n=n, fresh=i == 0)]
    return [*out, rec("opt_pre", t + 0.02, pid), rec("opt", t + 0.03, pid)]


def test_samples_come_from_completed_backwards_after_the_last_clear() -> None:
    # In-process retry: 32 + (OOM at the second 32) then 16 x 4 on cleared gradients.
    records = [rec("proc", 0.0), rec("fwd", 1.0, n=32), rec("bwd", 1.1, n=32, fresh=True), rec("fwd", 1.2, n=32),
               *step(2.0, [16, 16, 16, 16]), *step(3.0, [16, 16, 16, 16]), *step(4.0, [16, 16, 16, 16])]
    tr = peers.trace(records)
    assert [s.samples for s in tr.steps] == [64, 64, 64]
    assert [s.micro for s in tr.steps] == [16, 16, 16]
    assert tr.ooms == [1.2]
    row = peers.summarize("oomguard-session", tr, 0.0, 5.0, 64, 3, best=None)
    assert row["trained_global"] == 64 and row["micro_batch"] == 16 and row["ooms"] == 1
    assert row["settle_s"] == pytest.approx(2.03) and row["steps_redone"] == 0 and row["ratio_to_best"] is None


def test_a_drifting_peer_shows_the_batch_it_really_trained() -> None:
    # HF-style: the whole loop restarts at int(64 * 0.9) = 57, one micro-batch per step.
    records = [rec("fwd", 1.0, n=64), *step(2.0, [57]), *step(2.5, [57]), *step(3.0, [57]), *step(3.5, [57])]
    row = peers.summarize("hf-auto-find-batch-size", peers.trace(records), 0.0, 4.0, 64, 4, best=57 / 0.5)
    assert row["requested_global"] == 64 and row["trained_global"] == 57
    assert row["samples_per_s"] == pytest.approx(114.0) and row["ratio_to_best"] == pytest.approx(1.0)


def test_closure_style_steps_and_thrown_away_trial_steps() -> None:
    # Lightning: optimizer.step(closure) begins before the forward; the finder's trial steps
    # (two at 8, then an OOM at 16) are thrown away before the real run of 2 steps at 8.
    def closure_step(t: float, n: int) -> list[dict[str, Any]]:
        return [rec("opt_pre", t), rec("fwd", t, n=n), rec("bwd", t + 0.1, n=n, fresh=True), rec("opt", t + 0.2)]

    records = [*closure_step(1.0, 8), *closure_step(2.0, 8), rec("opt_pre", 3.0), rec("fwd", 3.0, n=16),
               *closure_step(4.0, 8), *closure_step(5.0, 8)]
    tr = peers.trace(records)
    assert tr.ooms == [3.0]
    row = peers.summarize("lightning-batch-size-finder", tr, 0.0, 6.0, 64, 2, best=None)
    assert row["trained_global"] == 8 and row["steps_redone"] == 2 and row["settle_s"] == pytest.approx(4.2)


def test_an_oom_inside_the_optimizer_step_counts() -> None:
    records = [*step(1.0, [8]), rec("fwd", 2.0, n=8), rec("bwd", 2.1, n=8, fresh=True), rec("opt_pre", 2.2),
               rec("proc", 3.0, pid=2), *step(4.0, [4, 4], pid=2)]
    tr = peers.trace(records)
    assert tr.ooms == [2.2] and [s.samples for s in tr.steps] == [8, 8]


def test_the_warm_up_is_outside_the_timed_window() -> None:
    # Two slow first intervals (allocator pools, first-touch pages), then a steady 64 samples / 0.5 s.
    times = [0.0, 3.0, 5.0, 5.5, 6.0, 6.5, 7.0]
    steps = [peers.Step(t, 64, 16, 1) for t in times]
    assert peers.steady_rate(steps) == pytest.approx(128.0)
    assert peers.steady_rate(steps[:3]) == pytest.approx(32.0)  # too few steps: only the first interval goes


def test_cpu_clock_rates_ignore_time_the_core_spent_on_other_processes() -> None:
    # Each step costs the thread 0.5 s of CPU; another process held the core for 1.5 s during step 4
    # (wall 2 s) and the restart to pid 2 starts the CPU clock again.
    walls = [0.0, 0.5, 1.0, 1.5, 3.5, 4.0, 4.5, 5.0]
    cpus = [10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5]
    steps = [peers.Step(w, 64, 16, 1, c) for w, c in zip(walls, cpus, strict=True)]
    assert peers.step_rates(steps, "cpu") == [pytest.approx(128.0)] * 7
    assert peers.step_rates(steps, "wall")[3] == pytest.approx(32.0)
    restarted = [*steps[:3], peers.Step(6.0, 64, 16, 2, 0.4), peers.Step(6.5, 64, 16, 2, 0.9)]
    assert peers.step_rates(restarted, "cpu") == [pytest.approx(128.0)] * 3  # no interval spans two processes
    assert peers.step_rates([peers.Step(0.0, 64, 16, 1), peers.Step(1.0, 64, 16, 1)], "cpu") == []  # no cpu stamp
    row = peers.summarize("sweep@16", peers.trace([*step(1.0, [16] * 4), *step(2.0, [16] * 4), *step(5.0, [16] * 4)]),
                          0.0, 6.0, 64, 3, best=None, clock="cpu")
    assert row["samples_per_s"] is None and row["wall_samples_per_s"] == pytest.approx(21.3)  # records without cpu


def test_records_carry_the_threads_cpu_time_and_the_pace_spins_on_it(tmp_path: Path, monkeypatch: Any) -> None:
    sys.path.insert(0, str(peers.KIT))
    try:
        import workload
    finally:
        sys.path.remove(str(peers.KIT))
    monkeypatch.setattr(workload, "RECORDS", workload.Records(str(tmp_path / "r.jsonl")))
    workload.mark("opt")
    (line,) = peers.read_records(tmp_path / "r.jsonl")
    assert 0 < line["cpu"] <= __import__("time").thread_time()
    monkeypatch.setenv("PEERS_SLOWDOWN", "0.5")
    monkeypatch.setenv("PEERS_DEVICE", "cpu")
    pace = workload.Pace()
    assert pace.clock is __import__("time").thread_time
    start = pace.clock()
    while pace.clock() - start < 0.05:  # a step's own work
        pass
    pace.step_done()
    assert pace.clock() - start >= 0.075  # the spin added half the step's CPU time


def test_the_canary_cancels_a_load_burst_within_a_round() -> None:
    # The box's memory got busy from wall second 10 on: the canary and the job slowed alike there.
    canary = [peers.Step(t, 64, 16, 9, t * (0.5 if t < 10 else 0.6)) for t in range(20)]
    assert peers.window_rate(canary, [2.0, 8.0]) == pytest.approx(128.0)
    assert peers.window_rate(canary, [12.0, 18.0]) == pytest.approx(64 / 0.6)
    assert peers.window_rate(canary, [12.2, 12.5]) == pytest.approx(64 / 0.6)  # no step inside: the one around
    assert peers.window_rate(canary, [25.0, 30.0]) is None  # the canary had stopped
    calm = {"samples_per_s": 128.0, "vs_canary": 128.0 / 128.0}
    slowed_in_burst = {"samples_per_s": 64 / 0.6 / 1.05, "vs_canary": (64 / 0.6 / 1.05) / (64 / 0.6)}
    raw = peers.paired([slowed_in_burst], [calm])[0]
    assert raw is not None and raw < 0.8  # the burst, not the 5 %, dominates the raw ratio
    assert peers.paired([slowed_in_burst], [calm], "vs_canary")[0] == pytest.approx(1 / 1.05)


def test_the_self_check_must_come_out_slower_in_every_round() -> None:
    assert peers.told_apart([0.94, 0.96, 0.95])
    assert not peers.told_apart([0.94, 1.01, 0.95])
    assert not peers.told_apart([0.94, None, 0.95])  # a round that missed one job proves nothing
    assert not peers.told_apart([])
    slowed = [{"contender": "sweep@16 slowed 5%", "skipped": "exited 1: Traceback\nRuntimeError: can't allocate"},
              {"samples_per_s": 95.0}]
    assert peers.missed_rounds(slowed, [{"samples_per_s": 100.0}] * 2) == [
        "round 1: sweep@16 slowed 5% RuntimeError: can't allocate"]


def test_the_q1_statistic_takes_the_least_disturbed_steps() -> None:
    # Nine steps of 64 samples: six undisturbed at 0.5 s of CPU, three slowed by other work on the core.
    seconds = [0.5, 0.5, 0.62, 0.5, 0.5, 0.58, 0.5, 0.71, 0.5]
    rates = [64 / s for s in seconds]
    assert peers.typical(rates, "median") == pytest.approx(128.0)
    assert peers.typical(rates, "q1") == pytest.approx(128.0)
    # q1 is one over the lower quartile of the seconds per sample (not the fastest single step)
    spread_out = [64 / s for s in (0.40, 0.50, 0.52, 0.60, 0.70)]
    assert peers.typical(spread_out, "q1") == pytest.approx(1 / (0.50 / 64))
    assert peers.typical(spread_out, "median") == pytest.approx(64 / 0.52)
    assert peers.typical([100.0], "q1") == pytest.approx(100.0) and peers.typical([], "q1") is None
    steps = [peers.Step(float(i), 64, 16, 1, c) for i, c in enumerate([0.0, 3.0, 5.0, 5.5, 6.2, 6.7, 7.2, 7.9, 8.4])]
    assert peers.steady_rate(steps, "cpu", "q1") == pytest.approx(128.0)  # the warm-up stays out of it
    assert peers.steady_rate(steps, "cpu", "median") == pytest.approx(128.0)
    row = peers.summarize("sweep@16", peers.Trace(steps), 0.0, 9.0, 64, 9, best=None, clock="cpu", stat="q1")
    assert set(row["by_stat"]) == set(peers.STATS) and row["samples_per_s"] == pytest.approx(128.0)
    assert peers.parse_args([]).stat == "q1" and peers.parse_args(["--stat", "median"]).stat == "median"


def test_the_self_check_reports_the_other_statistic_of_the_same_steps() -> None:
    slowed = {"by_stat": {"q1": 95.0, "median": 99.0}, "vs_canary_by_stat": {"q1": 0.95, "median": 1.01}}
    plain = {"by_stat": {"q1": 100.0, "median": 98.0}, "vs_canary_by_stat": {"q1": 1.0, "median": 1.0}}
    assert peers._ratio(slowed, plain, "q1", "vs_canary") == pytest.approx(0.95)
    assert peers._ratio(slowed, plain, "median", "samples_per_s") == pytest.approx(99 / 98)
    assert peers._ratio({}, plain, "q1", "vs_canary") is None
    text = peers.other_stats({"ratios_by_stat": {"q1": [0.95, 0.96], "median": [0.97, 1.01]}}, "q1")
    assert "By the median instead" in text and "0.970, 1.010" in text and "NOT told apart" in text
    assert "q1" not in text


def test_getrusage_per_step_comes_from_the_records() -> None:
    records = [rec("proc", 0.0)]
    for i in range(5):
        records += step(1.0 + i, [16] * 4)
        records[-1].update(cpu=0.5 * i, minflt=1000 * i * i, utime=0.45 * i, stime=0.05 * i)
    tr = peers.trace(records)
    assert tr.steps[2].usage == {"minflt": 4000, "utime": pytest.approx(0.9), "stime": pytest.approx(0.1)}
    usage = peers.step_usage(tr.steps[2:])  # intervals 2-3, 3-4: 5000 and 7000 faults
    assert usage == {"minflt": 6000, "utime": pytest.approx(0.45), "stime": pytest.approx(0.05)}
    assert peers.step_usage([peers.Step(0.0, 64, 16, 1), peers.Step(1.0, 64, 16, 1)]) is None  # older records


def test_only_with_no_contender_runs_the_self_check_and_the_sweep() -> None:
    args = peers.parse_args(["--only", "--sweep-min", "16", "--no-bisect"])
    assert args.only == []
    fit = {"fitting_divisors": [1, 2, 4, 8, 16], "largest_fitting": 16, "smallest_failing": 32}
    jobs, skipped = peers.plan_jobs(args, fit)
    assert [j.label for j in jobs] == ["sweep@16", "sweep@16 slowed 5%"] and skipped == []


def test_the_workload_records_why_a_step_cost_what_it_did() -> None:
    # In a process of its own: importing the workload hooks every optimizer step of the process.
    code = ("import json, workload\n"
            "before = workload.thread_usage(); sum(range(300_000)); after = workload.thread_usage()\n"
            "print(json.dumps({'before': before, 'after': after, 'settings': workload.settings(),"
            " 'prefixes': list(workload.SETTINGS_ENV)}))")
    env = {"PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "2", "OOMGUARD_ATTEMPT": "3", "SECRET_THING": "x"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT / "bench" / "peerkit", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got["before"]) == {"minflt", "majflt", "utime", "stime"}
    assert got["after"]["utime"] + got["after"]["stime"] > got["before"]["utime"] + got["before"]["stime"]
    settings = got["settings"]
    assert {"nice", "threads", "interop", "cpus", "rlimit_as", "pythonpath", "probe"} <= set(settings)
    assert settings["env"] == {"MALLOC_ARENA_MAX": "2", "OOMGUARD_ATTEMPT": "3"}  # only what could change speed
    assert settings["probe"] is False  # no oomguard probe in a plain process (an editable install's finder is not one)


def test_a_contender_needing_a_flag_this_oomguard_lacks_is_skipped_with_the_reason() -> None:
    help_text = "usage: oomguard run [--grow] [--grow-after SECONDS]\n  --grow   after a stable period\n"
    assert peers.missing_flags("oomguard-run-grow", help_text) is None
    why = peers.missing_flags("oomguard-run-predict", help_text)
    assert why is not None and "--predict-shrink" in why and "--grow," not in why
    assert peers.missing_flags("oomguard-run-predict", help_text + "  --predict-shrink  jump\n") is None
    assert peers.missing_flags("oomguard-run-grow", "  --grow-after SECONDS\n") is not None  # not a prefix match
    assert peers.skip_reason("oomguard-run-predict", "cpu", help_text) == why
    assert peers.skip_reason("oomguard-run", "cpu", help_text) is None


def test_rounds_rotate_and_figures_carry_their_spread() -> None:
    jobs = [peers.Job(n, n) for n in "abcdef"]
    orders = [[j.label for j in peers.rotated(jobs, r, 3)] for r in range(3)]
    assert orders == [list("abcdef"), list("cdefab"), list("efabcd")]
    assert peers.spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert peers.fmt({"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}) == "2.0 (1.0–3.0)"
    assert peers.fmt({"median": 2.0, "min": 2.0, "max": 2.0, "n": 3}) == "2.0" and peers.fmt(None) == "–"


def test_ratios_are_paired_within_a_round() -> None:
    # The machine got twice as slow in round 2: both jobs felt it, their paired ratio did not.
    contender = [{"samples_per_s": 95.0}, {"samples_per_s": 47.5}, {"skipped": "x"}]
    best = [{"samples_per_s": 100.0}, {"samples_per_s": 50.0}, {"samples_per_s": 100.0}]
    assert peers.paired(contender, best) == [pytest.approx(0.95), pytest.approx(0.95), None]
    row = peers.aggregate("oomguard-run", [
        {"contender": "oomguard-run", "requested_global": 64, "trained_global": 64, "micro_batch": 16, "ooms": 2,
         "settle_s": s, "wall_s": 20.0, "samples_per_s": r, "steps_redone": 0}
        for s, r in ((10.0, 95.0), (12.0, 47.5))], best[:2], {16: best[:2]})
    assert row["ratio_to_best"]["median"] == pytest.approx(0.95) and row["ratio_to_best"]["max"] < 1
    assert row["ratio_to_same_size"]["median"] == pytest.approx(0.95)
    assert row["settle_s"] == {"median": 11.0, "min": 10.0, "max": 12.0, "n": 2}


def test_the_sweep_runs_the_script_oomguard_run_supervises(tmp_path: Path) -> None:
    args = peers.parse_args(["--global-batch", "64"])
    cmd, env = peers.command_for(peers.sweep_job(16), args, tmp_path)
    run_cmd, _ = peers.command_for(peers.Job("oomguard-run", "oomguard-run"), args, tmp_path)
    assert cmd[1] == run_cmd[-9] == str(peers.KIT / "train_plain.py")
    assert cmd[cmd.index("--batch-size") + 1] == "16" and cmd[cmd.index("--global-batch") + 1] == "64"
    assert env["PEERS_SLOWDOWN"] == "0.0" and env["OMP_NUM_THREADS"] == "1"
    _, slow = peers.command_for(peers.sweep_job(16, 0.05), args, tmp_path)
    assert slow["PEERS_SLOWDOWN"] == "0.05"
    assert slow["PEERS_BUDGET_MB"] == "0" and env["PEERS_BUDGET_MB"] == str(args.budget_mb)  # the check: no cap
    assert args.clock == "cpu" and peers.parse_args(["--device", "cuda"]).clock == "wall"
    grow, _ = peers.command_for(peers.Job("oomguard-run-predict", "oomguard-run-predict"), args, tmp_path)
    supervisor, worker = grow[:grow.index("--")], grow[grow.index("--"):]
    assert {"--grow", "--predict-shrink", "--grow-after"} <= set(supervisor) and "--grow" not in run_cmd
    assert worker[-2:] == ["--save-every", str(peers.GROW_SAVE_EVERY)]  # grow restarts at a checkpoint


bench_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "accelerate", "lightning")),
    reason="the benchmark's [bench] extra is not installed (pip install -e '.[bench]')",
)


@pytest.mark.timeout(600)  # several fresh torch processes; a loaded 2-core box is slow
@bench_extra
def test_tiny_benchmark_writes_the_issue_schema(tmp_path: Path) -> None:
    # No canary: it trains on a core of its own through the whole round (a third torch process beside the job and
    # the other test process on a 2-core CI box) for a pairing this test does not check (window_rate's tests do).
    out, docs, work = tmp_path / "peers.json", tmp_path / "docs", tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "--rounds", "1", "--steps", "4", "--global-batch", "16",
           "--budget-mb", "100", "--no-bisect", "--sweep-min", "8", "--check", "0", "--no-canary", "--only",
           "oomguard-run", "composer-auto-microbatch", "--json", str(out), "--docs", str(docs), "--work", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["contender"]: r for r in result["contenders"]}
    assert set(rows) == {"oomguard-run", "composer-auto-microbatch"}
    row = rows["oomguard-run"]
    assert set(peers.KEYS) <= set(row), row
    split = result["restart_splits"][0][0]
    assert set(peers.SEGMENTS) <= set(split) and split["teardown, notice and decide"] > 0, split
    # oomguard runs the script itself, so its restarts can come from a spare interpreter (a wrapper
    # between them once kept the spare out of this benchmark)
    journal = Journal(work / "round-1" / "oomguard-run" / "run", readonly=True)
    assert journal.event_data("spare_used"), "no restart of the benchmark's oomguard-run came from a spare"
    # the global batch stays exact although 16 did not fit: a smaller micro-batch, accumulated
    assert row["requested_global"]["median"] == row["trained_global"]["median"] == 16, row
    assert row["micro_batch"]["median"] < 16 and row["ooms"]["median"] >= 1, row
    assert 0 < row["settle_s"]["median"] <= row["wall_s"]["median"] and row["ratio_to_best"]["median"] > 0
    # trained_global is what the script's own records say the last optimizer step trained on
    records = peers.read_records(work / "round-1" / "oomguard-run" / "records.jsonl")
    last_step = peers.trace(records).steps[-1]
    assert last_step.samples == 16 and last_step.micro == row["micro_batch"]["median"]
    if importlib.util.find_spec("composer") is None:
        assert "torch" in rows["composer-auto-microbatch"]["skipped"]
    # 16 sits at the budget's edge: the fit probe (2 steps) may fit it where oomguard's worker (4) did not
    fit = result["fits"]
    assert fit["largest_fitting"] in (8, 16) and fit["fitting_divisors"] == peers.divisors(fit["largest_fitting"])
    assert [s["micro"] for s in result["sweep"]] == [m for m in (8, 16) if m <= fit["largest_fitting"]]
    assert result["best_micro"] in (8, 16)
    # oomguard-run settled at 8, the sweep timed 8 with the same script: the ratio is its tax plus noise
    assert row["ratio_to_same_size"]["median"] > 0
    assert "oomguard-run" in (docs / "peers.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (docs / "peers.png").stat().st_size > 10_000
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--render", str(out), "--docs",
                            str(tmp_path / "again")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert again.returncode == 0 and (tmp_path / "again" / "peers.md").read_text() == (docs / "peers.md").read_text()
