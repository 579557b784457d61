"""The CUDA side of the memory breakdown (issue 38.3), on a real GPU: skipped without one.

Micro-batch 16 then 8 meet a real CUDA OOM under a 2.5 GiB per-process memory fraction (256 MiB of
activations a sample), 4 fits. The first OOM's breakdown splits the allocator's memory exactly as
the script counts its own tensors; the attempt after it records the allocator's history, and its OOM
saves the snapshot PyTorch's memory viewer opens, per rank, in the run directory, with the largest
allocations by the script's own line in the report. The cost of recording is measured and printed.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import oomguard

from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.report import format_report, read_report

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the snapshot needs a GPU")

PY = sys.executable
WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "breakdown.py")
FAST = ["--no-web", "--backoff", "0.05", "--max-backoff", "0.2", "--sample-interval", "0.2", "--grace-period", "5"]
FIXED = ("weights", "frozen_weights", "gradients", "optimizer_state")


def test_a_cuda_oom_splits_the_allocator_and_the_next_saves_its_snapshot(tmp_path: Path) -> None:
    figures = tmp_path / "figures.json"
    figures.write_text("{}")
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), *FAST, "--micro-batch", "16", "--global-batch", "32",
                   "--", PY, WORKER, "adamw", "{micro_batch}", "4", str(figures), "--accum", "{grad_accum}",
                   "--cuda-limit-mib", "2560", "--sample-mib", "256", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    own = json.loads(figures.read_text())
    journal = Journal(tmp_path / "run", readonly=True)
    found = [e["data"] for e in journal.events(0, 100_000) if e["kind"] == "memory_breakdown"]
    journal.close()
    ooms = [e for e in found if e["at"] == "oom"]
    assert [(e["attempt"], e["micro_batch"]) for e in ooms] == [(1, 16), (2, 8)], found
    for event in ooms:
        assert {k: event[k] for k in FIXED} == own and event["device"] == "cuda:0", event
        assert event["limit_kind"] == "gpu" and event["cache"] >= 0 and event["activations"] > 0, event
        assert event["total"] == event["weights"] + event["gradients"] + event["optimizer_state"] + \
            event["activations"] + event["cache"], event
    assert ooms[0]["snapshot"] is None and ooms[1]["snapshot"] == str(
        tmp_path / "run" / "memory" / "snapshot-attempt2-rank0.pickle"), ooms
    snap = pickle.loads(Path(ooms[1]["snapshot"]).read_bytes())
    assert snap["segments"] and "device_traces" in snap
    assert "breakdown.py" in ooms[1]["stacks"][0]["where"], ooms[1]["stacks"]  # the activations' line
    text = format_report(read_report(tmp_path / "run"))
    assert "    snapshot: " in text and "allocations at " in text, text
    print("\n" + "\n".join(line for line in text.splitlines() if line.startswith(("    memory", "    snapshot",
                                                                                   "      ", "    across"))))


COST = """
import time, torch
x = torch.empty(1, device="cuda")
def run():
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(2000):
        a = [torch.empty(1 << 20, device="cuda") for _ in range(8)]
        del a
    torch.cuda.synchronize(); return time.perf_counter() - t
run(); plain = run()
torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
recorded = run()
print(plain, recorded)
"""


def test_the_cost_of_recording_the_allocators_history() -> None:
    """16,000 allocations and frees, without and with the history the probe records (the issue asks for it)."""
    out = subprocess.run([PY, "-c", COST], capture_output=True, text=True, timeout=120, env=dict(os.environ),
                         check=True)
    plain, recorded = map(float, out.stdout.split())
    print(f"\nallocator history: {plain / 16000 * 1e6:.2f} us -> {recorded / 16000 * 1e6:.2f} us an allocation+free "
          f"({recorded / plain:.1f}x), at {time.strftime('%H:%M')}")
    assert recorded > 0 and plain > 0
