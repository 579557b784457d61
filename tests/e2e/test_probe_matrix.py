"""The probe is invisible (issue 35): each plain-PyTorch case is a real process run plain and with the
probe, from the same seed; the losses are bitwise the same, and so are dynamo's graphs, frames,
recompiles and graph breaks (tests/probing_matrix.py). docs/probe.md tabulates what the probe does in
each case and what it costs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from probing_matrix import MATRIX_DIR, Run, assert_invisible, run_once, run_pair, tax, warnings

TINY = str(MATRIX_DIR / "tiny.py")
# A compile with a cold inductor cache takes minutes on a loaded 2-core box (the cache is shared: later ones do not).
pytestmark = pytest.mark.timeout(900)
TAX_BOUND = 1.5  # loose: a loaded 2-core CI box; the measured ratios are in docs/probe.md


def pair(tmp: Path, case: str, steps: int = 8) -> tuple[Run, Run]:
    plain, probed = run_pair(tmp, [TINY, "--case", case, "--steps", str(steps)])
    if case == "max_autotune" and (plain.losses != probed.losses or warnings(plain.stderr) != warnings(probed.stderr)):
        # max-autotune benchmarks kernels while it compiles: with a cold cache the plain run's choice may
        # differ from a later one's (ties under load), and only a cold run prints its benchmarking (seen
        # on a fresh CI box). The probed run took the plain run's from the cache; a second plain run, with
        # the same cache, is the fair comparison.
        plain = run_once(tmp / "plain-again", [TINY, "--case", case, "--steps", str(steps)], probed=False)
    return plain, probed


def assert_no_tax(tmp: Path, case: str, steps: int, plain: Run, probed: Run) -> None:
    """The probed run's steady step time within TAX_BOUND of the plain run's, in the best of three
    pairs: a tax of ours shows in every pair, while the other test process on a 2-core box slows one
    run of a pair now and then (a compiled step of 2 ms read 1.61 once in a full CI run)."""
    ratios = [tax(plain, probed, warmup=5)]
    for again in range(2):
        if min(ratios) < TAX_BOUND:
            break
        plain, probed = run_pair(tmp / f"again-{again}", [TINY, "--case", case, "--steps", str(steps)])
        ratios.append(tax(plain, probed, warmup=5))
    assert min(ratios) < TAX_BOUND, ratios


def test_eager(tmp_path: Path) -> None:
    plain, probed = pair(tmp_path, "eager", steps=30)
    assert_invisible(plain, probed)
    assert probed.steps() == 30 and not plain.counters  # eager: dynamo never imported
    assert_no_tax(tmp_path, "eager", 30, plain, probed)


@pytest.mark.parametrize("case", ["compile", "fullgraph", "dynamic", "max_autotune"])
def test_compiled_model(tmp_path: Path, case: str) -> None:
    plain, probed = pair(tmp_path, case, steps=30 if case == "compile" else 8)
    assert_invisible(plain, probed)
    assert plain.counters["stats"]["unique_graphs"] >= 1 and not plain.counters.get("recompiles")
    assert probed.steps() == len(plain.losses)  # the optimizer step is eager: counted
    [said] = probed.probe("partial")  # once: no forward figures in a process that compiled before its first step
    assert "no forward figures" in said["detail"]
    if case == "compile":
        assert_no_tax(tmp_path, case, 30, plain, probed)


def test_compiled_optimizer_step(tmp_path: Path) -> None:
    """``torch.compile(opt.step)``: dynamo traces the step hook; it does nothing there but store a
    constant, so such steps go uncounted, said once. The optimizer step's own graph breaks
    (torch/optim/optimizer.py) leave resume frames; with a global post hook registered dynamo enters
    one frame fewer (measured 7 against 8), so frames are not compared: graphs, recompiles and graph
    breaks are."""
    plain, probed = pair(tmp_path, "compiled_opt", steps=6)
    assert_invisible(plain, probed, skip_counters=("frames",))
    assert probed.steps() is None  # no step counted: every optimizer step ran compiled
    details = [r["detail"] for r in probed.probe("partial")]
    assert any("optimizer steps run inside torch.compile are not counted" in d for d in details), details
    assert len(details) == len(set(details))  # each said once


@pytest.mark.parametrize("case", ["ckpt_reentrant", "ckpt_nonreentrant", "two", "loader_fork", "loader_spawn"])
def test_eager_variants(tmp_path: Path, case: str) -> None:
    plain, probed = pair(tmp_path, case, steps=6)
    assert_invisible(plain, probed)
    assert probed.steps() == 6  # two optimizers stepped in one iteration: one step
    loaded = {r["pid"] for r in probed.probe("loaded")}
    assert len(loaded) == 1  # the training process only: data-loader workers never step, so never say it


def test_torch_func_takes_no_optimizer_step(tmp_path: Path) -> None:
    """torch.func's functional_call and grad with an update by hand: no optimizer, so no step is
    counted and the probe says nothing (the supervisor reads steps from the output)."""
    plain, probed = pair(tmp_path, "func", steps=6)
    assert probed.losses == plain.losses
    assert probed.records == [] and probed.stderr == plain.stderr


def test_amp_gradscaler_skipped_step_is_no_optimizer_step(tmp_path: Path) -> None:
    """CPU autocast (bfloat16) with a GradScaler whose step 2 overflows: the scaler skips
    optimizer.step, the post hook does not fire, and the probe's step is the optimizer's."""
    plain, probed = pair(tmp_path, "amp", steps=6)
    assert_invisible(plain, probed)
    assert plain.extra["skipped"] == [2] and probed.extra == plain.extra
    assert probed.steps() == plain.extra["optimizer_steps"] == 5


@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_distributed_on_gloo(tmp_path: Path, how: str) -> None:
    if how == "fsdp2":
        fsdp = pytest.importorskip("torch.distributed.fsdp")
        if not hasattr(fsdp, "fully_shard"):
            pytest.skip(f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    plain, probed = run_pair(tmp_path, [str(MATRIX_DIR / "dist.py"), "--how", how, "--steps", "6"])
    assert_invisible(plain, probed)
    assert sorted(r["rank"] for r in probed.probe("loaded")) == [0, 1]
    assert probed.steps() == 6
