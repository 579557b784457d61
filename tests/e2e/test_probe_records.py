"""`oomguard run` with a worker that writes the in-process probe's records (simulated: the worker
appends the ``step``, ``oom`` and ``probe`` records the probe writes, tests/workers/simulated_probe.py)
and dies of a CUDA-OOM-like error: the cause line carries the allocator's figures, status's step is
the worker's last optimizer step, not the step-looking lines it printed."""

from __future__ import annotations

import sys
from pathlib import Path

from support import WORKERS, oomguard, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
SIMULATED_PROBE = str(WORKERS / "simulated_probe.py")
FAST = ["--no-web", "--backoff", "0.05", "--max-backoff", "0.2"]
GIB = 2**30
MIB = 2**20


def test_cuda_ooms_are_told_in_the_allocators_figures_and_steps_come_from_the_probe(run_dir: Path) -> None:
    out = oomguard("run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "16", "--global-batch", "64", "--",
                   PY, SIMULATED_PROBE, "--fail-above", "4", "--steps", "12", "--fraction", "0.3", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "done micro=4 steps=12" in out.stdout and "step 120: loss" in out.stdout
    doc = status(run_dir)
    assert doc["state"] == "succeeded" and [f["micro_batch"] for f in doc["failures"]] == [16, 8]
    # The probe's count, not the output's "step 120".
    assert doc["progress"]["step"] == 12 and doc["progress"]["source"] == "probe", doc["progress"]
    assert doc["progress"]["steps_per_s"] > 0 and doc["progress"]["limit_bytes"] == int(80 * GIB * 0.3)
    assert [p["peak_allocated"] for p in doc["peaks"]] == [(1024 + 256 * m) * MIB for m in (16, 8, 4)]
    first, second = (f["cause"]["summary"] for f in doc["failures"])
    assert first == ("micro-batch 16 needed at least 24.2 GiB: it asked for 256.0 MiB more with 23.9 GiB allocated; "
                     "the limit was 24.0 GiB (30% of the device); 60.0 MiB more was reserved but unallocated"), first
    # The per-sample figure from the allocator's step peaks at 16 (5 GiB over 16 samples, fixed memory included).
    assert second.startswith("micro-batch 8 needed at least "), second
    assert second.endswith("; 60.0 MiB more was reserved but unallocated; at most 320.0 MiB a sample, "
                           "measured at 16"), second
    journal = Journal(run_dir, readonly=True)
    try:
        causes = journal.event_data("attribution")
        frag = journal.event_data("fragmentation")
        ooms = journal.event_data("worker_oom")
    finally:
        journal.close()
    assert all("does not follow" not in c["summary"] and c["source"] == "allocator" for c in causes.values())
    assert causes[2]["per_sample_bytes"] == 320 * MIB and causes[1]["limit_bytes"] == int(80 * GIB * 0.3)
    assert frag[1]["fragmented"] is False and "allocator's figures" in frag[1]["why"]
    assert ooms[1]["device"] == "cuda:0" and ooms[1]["micro_batch"] == 16
    report = oomguard("report", "--run-dir", str(run_dir))
    assert report.returncode == 0, report.stderr
    assert "attempt 1 at micro-batch 16: allocated peak 5.0 GiB" in report.stdout
    assert "last progress: step 12," in report.stdout and "[probe]" in report.stdout
