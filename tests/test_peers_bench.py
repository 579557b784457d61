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

ROOT = Path(__file__).resolve().parent.parent


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


bench_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "accelerate", "lightning")),
    reason="the benchmark's [bench] extra is not installed (pip install -e '.[bench]')",
)


@pytest.mark.timeout(600)  # several fresh torch processes; a loaded 2-core box is slow
@bench_extra
def test_tiny_benchmark_writes_the_issue_schema(tmp_path: Path) -> None:
    out, docs, work = tmp_path / "peers.json", tmp_path / "docs", tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "--rounds", "1", "--steps", "4", "--global-batch", "16",
           "--budget-mb", "100", "--no-bisect", "--sweep-min", "8", "--check", "0", "--only",
           "oomguard-run", "composer-auto-microbatch", "--json", str(out), "--docs", str(docs), "--work", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["contender"]: r for r in result["contenders"]}
    assert set(rows) == {"oomguard-run", "composer-auto-microbatch"}
    row = rows["oomguard-run"]
    assert set(peers.KEYS) <= set(row), row
    split = result["restart_splits"][0][0]
    assert set(peers.SEGMENTS) <= set(split) and split["teardown"] > 0 and split["imports"] > 0, split
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
