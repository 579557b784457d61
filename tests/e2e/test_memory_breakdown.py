"""What filled memory at every memory failure (issue 38), end to end with real processes.

A real RLIMIT_AS OOM (``DefaultCPUAllocator: can't allocate memory``) in a script that writes what it
computes itself (its parameters', frozen parameters', gradients' and optimizer state's bytes): the
journal's ``memory_breakdown`` gives the same figures, byte for byte, for AdamW (beside the attempt
that fit at half the micro-batch, in the report), SGD with momentum and a model with frozen layers.
A kernel OOM kill in a real memory cgroup: the last reading before it names each process, the
DataLoader worker among them, and the cgroup's limit.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, MemoryCgroups, oomguard

from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.report import format_report, read_report

PY = sys.executable
WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "breakdown.py")
MIB = 2**20
# No spare interpreters: this file checks no spare, and each spare imports torch again beside the worker
# (spares have their own tests: test_spare*.py, test_ownfault.py, the frameworks' and probe matrices' default runs).
FAST = ["--no-web", "--no-spare", "--backoff", "0.05", "--max-backoff", "0.2", "--sample-interval", "0.2",
        "--grace-period", "5"]
FIXED = ("weights", "frozen_weights", "gradients", "optimizer_state")


@functools.cache
def torch_mapped_bytes() -> int:
    """The address space a Python that imported torch maps (the limit leaves room above it), read once."""
    code = "import torch, os; print(int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE'))"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return int(out.stdout.strip())


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    journal = Journal(run_dir, readonly=True)
    try:
        return [e["data"] for e in journal.events(0, 100_000) if e["kind"] == kind]
    finally:
        journal.close()


def rlimit_run(tmp: Path, kind: str, restarts: int) -> tuple[subprocess.CompletedProcess[str], dict[str, int], int]:
    """The script at micro-batch 16 under an address-space limit that 16 samples' 16 MiB do not fit, 8 do."""
    # (300 MiB above torch: 16 samples need 256 MiB besides what malloc maps around them, 8 need 128.)
    figures = tmp / "figures.json"
    figures.write_text("{}")
    limit = torch_mapped_bytes() + 300 * MIB
    out = oomguard("run", "--run-dir", str(tmp / "run"), *FAST, "--micro-batch", "16", "--global-batch", "32",
                   "--max-restarts", str(restarts),
                   *(["--min-micro-batch", "16"] if not restarts else []), "--", "prlimit", f"--as={limit}", PY,
                   WORKER, kind, "{micro_batch}", "4", str(figures), "--accum", "{grad_accum}", cwd=tmp, timeout=240)
    assert "DefaultCPUAllocator: can't allocate memory" in out.stdout + out.stderr, out.stdout[-3000:]
    return out, json.loads(figures.read_text()), limit


def check_oom(event: dict[str, Any], own: dict[str, int], limit: int, optimizer: str) -> None:
    """Each figure as the script computes it; the rest adds up to what the process held, under the limit."""
    assert {k: event[k] for k in FIXED} == own, (event, own)
    assert event["at"] == "oom" and event["device"] == "cpu" and event["optimizers"] == [optimizer], event
    assert event["limit"] == limit and event["limit_kind"] == "RLIMIT_AS" and event["cache"] is None, event
    assert event["measure"] == "address_space" and event["requested"] == 16 * MIB, event
    fixed = own["weights"] + own["gradients"] + own["optimizer_state"]
    assert event["activations"] > 0 and event["baseline"] > 0, event
    assert event["baseline"] + fixed + event["activations"] == event["total"] <= limit, event


def test_adamw_at_the_oom_and_at_the_peak_that_fit_beside_it_in_the_report(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, own, limit = rlimit_run(tmp_path, "adamw", 1)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert own["gradients"] == own["weights"] and own["optimizer_state"] > 2 * own["weights"]  # two moments, a step
    found = events(tmp_path / "run", "memory_breakdown")
    oom = [e for e in found if e["at"] == "oom"]
    peak = [e for e in found if e["at"] == "peak"]
    # 8 samples fit with room to spare; a box under load may still map more (malloc's arenas): then 4 does.
    assert (oom[0]["attempt"], oom[0]["micro_batch"]) == (1, 16) and len(peak) == 1, found
    assert peak[0]["attempt"] == oom[-1]["attempt"] + 1 and peak[0]["micro_batch"] < oom[-1]["micro_batch"], found
    for event in oom:
        check_oom(event, own, limit, "AdamW")
    assert {k: peak[0][k] for k in FIXED} == own and peak[0]["activations"] > 0, peak
    comparison = events(tmp_path / "run", "memory_comparison")[-1]
    assert (comparison["failed_attempt"], comparison["other_attempt"]) == (oom[-1]["attempt"], peak[0]["attempt"])
    assert f"at micro-batch {oom[-1]['micro_batch']}" in comparison["text"] and "AdamW state" in comparison["text"]
    text = format_report(read_report(tmp_path / "run"))
    # the line status shows (record/memoryparts.line), the host's activations said as the lower bound they are
    memory = f"    memory:   attempt {oom[-1]['attempt']} at micro-batch {oom[-1]['micro_batch']}"
    assert memory in text and ", activations at least " in text and f"    across:   {comparison['text']}" in text, text
    print("\n" + "\n".join(line for line in text.splitlines() if line.startswith(("    memory:", "    across:"))))


@pytest.mark.parametrize("kind", ["sgd", "frozen"])
def test_sgd_momentum_and_frozen_weights_at_the_oom(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGD's momentum buffers are its state, one per parameter; frozen weights have no gradient nor state."""
    pytest.importorskip("torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, own, limit = rlimit_run(tmp_path, kind, 0)
    assert out.returncode != 0
    (event,) = events(tmp_path / "run", "memory_breakdown")
    check_oom(event, own, limit, "SGD" if kind == "sgd" else "AdamW")
    if kind == "sgd":
        assert own["optimizer_state"] == own["weights"] == own["gradients"] and not own["frozen_weights"]
    else:
        assert own["frozen_weights"] == 3 * own["weights"] // 4 and own["gradients"] == own["weights"] // 4


def test_a_kernel_oom_kill_shows_each_process_of_the_cgroup_with_its_dataloader_worker(
        memory_cgroup: MemoryCgroups, tmp_path: Path, run_dir: Path) -> None:
    """The trainer keeps 2 MiB a step beside one DataLoader worker until the cgroup's limit has the kernel
    kill it: the last reading names the trainer, the data-loader worker and oomguard itself, and the limit."""
    pytest.importorskip("torch")
    limit = 480 * MIB
    cgroup = memory_cgroup(limit, name="oomguard-breakdown")
    figures = tmp_path / "figures.json"
    figures.write_text("{}")
    cmd = [PY, "-m", "oomguard", "run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "1", "--grad-accum", "1",
           "--max-restarts", "0", "--", PY, WORKER, "sgd", "{micro_batch}", "100000", str(figures), "--grow", "2",
           "--workers", "1"]
    joined = " ".join(f"'{a}'" for a in cmd)
    out = subprocess.run(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {joined}"], capture_output=True,
                         text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0 and (run_dir / "journal.sqlite").exists(), out.stdout[-3000:] + out.stderr[-3000:]
    # A rise this steady may be called a leak and restarted once at the same size: the first kill is the test's.
    found = [e for e in events(run_dir, "memory_breakdown") if e["attempt"] == 1]
    assert len(found) == 1, (found, out.stdout[-2000:])
    event = found[0]
    assert event["at"] == "last_reading" and event["limit"] == limit and event["limit_kind"] == "cgroup", event
    roles = {p["role"] for p in event["processes"]}
    assert {"trainer", "data-loader worker", "other"} <= roles, event["processes"]
    # (a process exiting at that reading, a zombie, reads 0; the cgroup's count nears its limit)
    # the trainer and at least one data-loader worker held memory at that reading
    held = {p["role"] for p in event["processes"] if p["rss"] > 0}
    assert {"trainer", "data-loader worker"} <= held and event["total"] > limit // 2, event
    trainer = next(p for p in event["processes"] if p["role"] == "trainer")
    assert trainer["rss"] > 100 * MIB, event  # torch, the model and what it kept
    text = format_report(read_report(run_dir))
    said = "    memory:   attempt 1 at micro-batch 1, last reading before the failure: no part seen; by process: "
    assert said in text, text
    assert "data-loader worker" in text and "limit 480.0 MiB (cgroup)" in text, text
    print("\n" + "\n".join(line for line in text.splitlines() if line.startswith("    memory:")))
