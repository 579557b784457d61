"""oomguard over torchrun, end to end: two real Gloo ranks on CPU, a real fault on rank 1 only.

Each test runs two attempts of a real DDP script (tests/workers/ddp_train.py) under torchrun; the
first dies on rank 1, the second must start both ranks at half the micro-batch from the newest
checkpoint with the global batch exact. Slow on a loaded 2-core box (torch is imported three times
per attempt), so each test is one run of two attempts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support import ROOT, WORKERS, MemoryCgroups, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
SCRIPT = str(WORKERS / "ddp_train.py")
TORCHRUN = str(Path(PY).parent / "torchrun")
BATCH = ["--micro-batch", "4", "--global-batch", "16"]  # per rank 8 = 4 × 2; halved: 2 × 4
SCRIPT_ARGS = ["--micro-batch-size", "{micro_batch}", "--gradient-accumulation-steps", "{grad_accum}"]


def oomguard_argv(run_dir: Path, ck: Path, *opts: str, command: list[str]) -> list[str]:
    return [PY, "-m", "oomguard", "run", "--run-dir", str(run_dir), "--no-web", "--backoff", "0.05", *BATCH,
            "--checkpoint", f"{ck}/step-*", "--resume-args", "--resume-from {checkpoint}", *opts, "--", *command]


def ranks_started(stdout: str) -> list[dict[str, float]]:
    pattern = (r"rank (\d) attempt (\d) micro (\d+) accum (\d+) world (\d) global (\d+) start_step (\d+) "
               r"spawned ([\d.]+) ready ([\d.]+)")
    keys = ("rank", "attempt", "micro", "accum", "world", "global", "start_step", "spawned", "ready")
    return [dict(zip(keys, map(float, m), strict=True)) for m in re.findall(pattern, stdout)]


def check_two_rounds(out: subprocess.CompletedProcess[str], run_dir: Path, ck: Path, kind: str) -> None:
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RuntimeWarning" not in out.stderr  # e.g. watchdog's, about re-watching a renamed checkpoint dir
    doc = status(run_dir)
    assert doc["state"] == "succeeded"
    assert [f["kind"] for f in doc["failures"]] == [kind]
    assert "rank 1 (local rank 1)" in doc["failures"][0]["evidence"]
    started = ranks_started(out.stdout)
    second = [r for r in started if r["attempt"] == 2]
    # Both ranks again, at half the micro-batch, the global batch exact, from the newest checkpoint.
    assert sorted(r["rank"] for r in second) == [0, 1]
    assert {(r["micro"], r["accum"], r["world"], r["global"], r["start_step"]) for r in second} == {(2, 4, 2, 16, 2)}
    journal = Journal(run_dir, readonly=True)
    assert journal.attempts()[1]["checkpoint"] == str(ck / "step-2")
    causes = [e["data"] for e in journal.events() if e["kind"] == "root_cause"]
    assert [c["rank"] for c in causes] == [1] and causes[0]["local_rank"] == 1
    fault = float(re.search(r"rank 1 fault \w+ at ([\d.]+)", out.stdout).group(1))  # type: ignore[union-attr]
    print(f"\nrestart latency ({kind}): failing rank's fault -> all ranks spawned again "
          f"{max(r['spawned'] for r in second) - fault:.2f} s, -> all ranks past rendezvous "
          f"{max(r['ready'] for r in second) - fault:.2f} s")


def test_allocator_oom_on_rank_1_under_a_torchrun_command(tmp_path: Path, run_dir: Path) -> None:
    """COMMAND is torchrun itself: the world size is read from its --nproc_per_node, not asked twice."""
    ck = tmp_path / "ck"
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2", SCRIPT, *SCRIPT_ARGS, "--ckpt-dir", str(ck),
               "--fault", "rlimit"]
    out = subprocess.run(oomguard_argv(run_dir, ck, command=command), capture_output=True, text=True,
                         timeout=150, env={**os.environ, "PYTHONPATH": str(ROOT)})
    check_two_rounds(out, run_dir, ck, "host_oom")
    evidence = status(run_dir)["failures"][0]["evidence"]
    assert "DefaultCPUAllocator: can't allocate memory" in evidence
    assert (run_dir / "logs" / "attempt-1.ranks").is_dir()  # torchrun's --log-dir: the ranks' error files


def test_kernel_oom_kill_of_rank_1_is_host_oom_not_crash(tmp_path: Path, run_dir: Path,
                                                         memory_cgroup: MemoryCgroups) -> None:
    """--nproc-per-node wraps a plain python command in torchrun; the kernel kills rank 1."""
    # 1.5 GiB for oomguard, torchrun and two ranks (about 1 GiB together)
    cgroup = memory_cgroup(1500 * 2**20, name="oomguard-torchrun-test")
    ck = tmp_path / "ck"
    argv = oomguard_argv(run_dir, ck, "--nproc-per-node", "2",
                         command=[PY, SCRIPT, *SCRIPT_ARGS, "--ckpt-dir", str(ck), "--fault", "touch"])
    joined = " ".join(f"'{a}'" for a in argv)
    out = subprocess.run(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {joined}"],
                         capture_output=True, text=True, timeout=150, env={**os.environ, "PYTHONPATH": str(ROOT)})
    check_two_rounds(out, run_dir, ck, "host_oom")
    failure = status(run_dir)["failures"][0]
    assert "killed by the kernel OOM killer" in failure["evidence"] and failure["signal"] == 9
