"""The probe is invisible (issue 35): each plain-PyTorch case is a real process run plain and with the
probe, from the same seed; the losses are bitwise the same, and so are dynamo's graphs, frames,
recompiles and graph breaks (tests/probing_matrix.py). docs/probe.md tabulates what the probe does in
each case and what it costs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from probing_matrix import MATRIX_DIR, Run, assert_invisible, run_pair, tax

TINY = str(MATRIX_DIR / "tiny.py")
TAX_BOUND = 1.5  # loose: a loaded 2-core CI box; the measured ratios are in docs/probe.md


def pair(tmp: Path, case: str, steps: int = 8) -> tuple[Run, Run]:
    return run_pair(tmp, [TINY, "--case", case, "--steps", str(steps)])


def test_eager(tmp_path: Path) -> None:
    plain, probed = pair(tmp_path, "eager", steps=30)
    assert_invisible(plain, probed)
    assert probed.steps() == 30 and not plain.counters  # eager: dynamo never imported
    assert tax(plain, probed, warmup=5) < TAX_BOUND


@pytest.mark.parametrize("case", ["compile", "fullgraph", "dynamic", "max_autotune"])
def test_compiled_model(tmp_path: Path, case: str) -> None:
    plain, probed = pair(tmp_path, case, steps=30 if case == "compile" else 8)
    assert_invisible(plain, probed)
    assert plain.counters["stats"]["unique_graphs"] >= 1 and not plain.counters.get("recompiles")
    assert probed.steps() == len(plain.losses)  # the optimizer step is eager: counted
    [said] = probed.probe("partial")  # once: no forward figures in a process that compiled before its first step
    assert "no forward figures" in said["detail"]
    if case == "compile":
        assert tax(plain, probed, warmup=5) < TAX_BOUND
