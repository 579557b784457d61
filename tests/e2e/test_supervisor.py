"""`oomguard run` end to end: real worker subprocesses, real signals, real kernel OOM kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import ROOT, WORKER, MemoryCgroups, oomguard, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
# No spare interpreters: this file checks no spare, and each spare imports torch again beside the worker
# (spares have their own tests: test_spare*.py, test_ownfault.py, the frameworks' and probe matrices' default runs).
FAST = ["--no-web", "--no-spare", "--backoff", "0.05", "--max-backoff", "0.2"]


def run(run_dir: Path, *opts: str, worker: list[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return oomguard("run", "--run-dir", str(run_dir), *FAST, *opts, "--", PY, WORKER, *worker, timeout=timeout)


def kinds(doc: dict) -> list[str]:  # type: ignore[type-arg]
    return [f["kind"] for f in doc["failures"]]


def test_a_pytorch_oom_text_halves_until_it_fits(run_dir: Path) -> None:
    out = run(run_dir, "--micro-batch", "16", "--global-batch", "64",
              worker=["torch_oom", "--fail-above", "4"])
    assert out.returncode == 0, out.stderr
    doc = status(run_dir)
    assert doc["state"] == "succeeded"
    assert (doc["micro_batch"], doc["grad_accum"], doc["global_batch"]) == (4, 16, 64)
    assert kinds(doc) == ["cuda_oom", "cuda_oom"]
    assert [f["micro_batch"] for f in doc["failures"]] == [16, 8]
    assert "torch.OutOfMemoryError: CUDA out of memory" in doc["failures"][0]["evidence"]
    assert doc["failures"][0]["exit_code"] == 1 and doc["failures"][0]["signal"] is None
    assert "worker attempt=3 micro=4 accum=16" in out.stdout  # the worker saw the same numbers
    # The tuned batch is durable: a new supervisor on this run directory starts at micro-batch 4.
    again = run(run_dir, "--micro-batch", "16", "--global-batch", "64", worker=["torch_oom"])
    assert again.returncode == 0 and "worker attempt=4 micro=4 accum=16" in again.stdout
    assert status(run_dir)["attempt"] == 4


def test_fragmentation_first_retries_same_batch_with_expandable_segments(run_dir: Path) -> None:
    out = run(run_dir, "--micro-batch", "16", "--global-batch", "64", worker=["fragmented"])
    assert out.returncode == 0, out.stderr
    assert "worker attempt=2 micro=16 accum=4 alloc_conf=expandable_segments:True" in out.stdout
    doc = status(run_dir)
    assert doc["micro_batch"] == 16 and doc["expandable_segments"] is True


def test_b_kernel_oom_killer_in_a_memory_cgroup(run_dir: Path, memory_cgroup: MemoryCgroups) -> None:
    cgroup = memory_cgroup(300 * 2**20)  # 300 MiB that the test puts oomguard itself into
    argv = [PY, "-m", "oomguard", "run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "16",
            "--global-batch", "64", "--", PY, WORKER, "allocate", "--mb-per-sample", "40"]
    joined = " ".join(f"'{a}'" for a in argv)
    out = subprocess.run(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {joined}"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    doc = status(run_dir)
    assert "host_oom" in kinds(doc) and set(kinds(doc)) == {"host_oom"}
    first = doc["failures"][0]
    assert first["signal"] == signal.SIGKILL and "oom_kill" in first["evidence"]
    # 16 and 8 samples × 40 MiB cannot fit in 300 MiB; 4 × 40 MiB does, beside the supervisor
    assert doc["state"] == "succeeded" and doc["micro_batch"] == 4 and doc["global_batch"] == 64


def test_c_memory_limit(run_dir: Path) -> None:
    out = run(run_dir, "--micro-batch", "16", "--global-batch", "64", "--memory-limit", "200M",
              worker=["allocate", "--mb-per-sample", "30"])
    assert out.returncode == 0, out.stderr
    doc = status(run_dir)
    assert set(kinds(doc)) == {"memory_limit"}, doc["failures"]
    assert doc["micro_batch"] == 4 and doc["grad_accum"] == 16
    assert "--memory-limit" in doc["failures"][0]["evidence"]


def test_d_hang_is_detected_dumped_and_restarted(run_dir: Path) -> None:
    out = run(run_dir, "--micro-batch", "8", "--grad-accum", "2", "--hang-timeout", "1.5", worker=["hang"])
    assert out.returncode == 0, out.stderr
    doc = status(run_dir)
    assert kinds(doc) == ["hang"] and "no output or progress" in doc["failures"][0]["evidence"]
    assert doc["micro_batch"] == 8  # a hang is not a memory problem
    log = (run_dir / "logs" / "attempt-1.log").read_text()
    assert "most recent call first" in log and "in hang" in log  # faulthandler's stack dump


def test_e_crash_loop_fails_with_reason(run_dir: Path) -> None:
    out = run(run_dir, "--micro-batch", "8", "--grad-accum", "2", worker=["crash"])
    assert out.returncode == 1
    doc = status(run_dir)
    assert doc["state"] == "failed" and kinds(doc) == ["crash"] * 3
    assert "crash loop" in doc["reason"] and "bad data in shard 7" in doc["reason"]
    assert doc["failures"][0]["exit_code"] == 3


def wait_for(predicate, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def start(run_dir: Path, pidfile: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-m", "oomguard", "run", "--run-dir", str(run_dir), *FAST,
                             "--micro-batch", "8", "--grad-accum", "2", "--grace-period", "2", "--",
                             PY, WORKER, "pidfile", "--pidfile", str(pidfile)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_f_external_sigkill_is_killed_and_restarted(run_dir: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    proc = start(run_dir, pidfile)
    wait_for(pidfile.exists)
    worker = int(pidfile.read_text())
    # The worker is the kernel's first choice, not us.
    assert psutil.Process(worker).children() == []
    adj = int(Path(f"/proc/{worker}/oom_score_adj").read_text())
    assert adj > int(Path(f"/proc/{proc.pid}/oom_score_adj").read_text())
    os.kill(worker, signal.SIGKILL)
    assert proc.wait(timeout=30) == 0
    doc = status(run_dir)
    assert kinds(doc) == ["killed"] and doc["failures"][0]["signal"] == signal.SIGKILL
    assert doc["state"] == "succeeded" and doc["micro_batch"] == 8


def test_g_truncated_newest_checkpoint_falls_back(run_dir: Path, tmp_path: Path) -> None:
    import torch

    ck = tmp_path / "ck"
    for step in (1, 2):
        (ck / f"checkpoint-{step}").mkdir(parents=True)
        torch.save({"step": step, "w": torch.zeros(1000)}, ck / f"checkpoint-{step}" / "state.pt")
    newest = ck / "checkpoint-2" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:300])  # truncated mid-write
    out = run(run_dir, "--micro-batch", "8", "--grad-accum", "2", "--checkpoint", f"{ck}/checkpoint-*",
              "--resume-args", "--resume-from {checkpoint}", worker=["resume"])
    assert out.returncode == 0, out.stderr
    assert f"resumed from {ck}/checkpoint-1 step 1" in out.stdout
    journal = Journal(run_dir, readonly=True)
    attempts = journal.attempts()
    assert attempts[0]["checkpoint"] == str(ck / "checkpoint-2")
    assert attempts[1]["checkpoint"] == str(ck / "checkpoint-1")
    assert journal.bad_checkpoints() == {str(ck / "checkpoint-2")}
    assert "--resume-from" in attempts[1]["command"]


def test_checkpoint_step_of_a_name_without_a_step_comes_from_the_output(run_dir: Path, tmp_path: Path) -> None:
    """``{checkpoint_step}`` for nanoGPT's ``ckpt.pt``: the step the output showed when it was written."""
    ck = tmp_path / "ck"
    out = run(run_dir, "--micro-batch", "8", "--grad-accum", "2", "--checkpoint", f"{ck}/ckpt.txt",
              "--resume-args", "--resume-step {checkpoint_step}", worker=["stepless_checkpoint", "--ckpt-dir", str(ck)])
    assert out.returncode == 0, out.stderr
    assert "resume step given '4', in the file '4'" in out.stdout
    # A new supervisor on the run directory knows the step from the journal, and says so.
    again = run(run_dir, "--micro-batch", "8", "--grad-accum", "2", "--checkpoint", f"{ck}/ckpt.txt",
                "--resume-args", "--resume-step {checkpoint_step}",
                worker=["stepless_checkpoint", "--ckpt-dir", str(ck)])
    assert again.returncode == 0 and "resume step given '4', in the file '4'" in again.stdout, again.stderr
    resumed = [e["data"] for e in Journal(run_dir, readonly=True).events() if e["kind"] == "resume_point"]
    assert [(r["step"], r["step_from"]) for r in resumed] == [(4, "output"), (4, "journal")]


def test_second_supervisor_refused_and_sigterm_stops_the_group(run_dir: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    proc = start(run_dir, pidfile)
    try:
        wait_for(pidfile.exists)
        worker = int(pidfile.read_text())
        second = run(run_dir, "--micro-batch", "8", "--grad-accum", "2", worker=["crash"])
        assert second.returncode == 2
        assert second.stderr.strip().count("\n") == 0 and "already supervised by pid" in second.stderr
        assert f"(oomguard stop --run-dir {run_dir})" in second.stderr  # a hint that works as printed
        wait_for(lambda: status(run_dir)["worker_pid"] == worker)  # the training process, not launch.py
        doc = status(run_dir)
        assert doc["state"] == "running" and doc["supervisor_alive"]
        os.kill(proc.pid, signal.SIGHUP)  # not fatal
        time.sleep(0.3)
        assert proc.poll() is None and psutil.pid_exists(worker)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert not psutil.pid_exists(worker)
        assert status(run_dir)["state"] == "stopped"
    finally:
        proc.kill()


def test_no_orphans_when_the_supervisor_is_sigkilled(run_dir: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    proc = start(run_dir, pidfile)
    wait_for(pidfile.exists)
    worker = int(pidfile.read_text())
    proc.kill()
    proc.wait()
    wait_for(lambda: not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE,
             timeout=10)
    doc = status(run_dir)  # the journal survived kill -9 and still reads
    assert doc["state"] == "running" and doc["supervisor_alive"] is False


@pytest.mark.parametrize("args,needle", [
    (["run", "--micro-batch", "8", "--grad-accum", "2", "--frobnicate", "--", "true"], "--frobnicate"),
    (["run", "--micro-batch", "8", "--grad-accum", "2", "--memory-limit", "12parsecs", "--", "true"],
     "--memory-limit"),
    (["run", "--micro-batch", "8", "--global-batch", "60", "--", "true"], "--micro-batch: 8 does not divide"),
    (["run", "--micro-batch", "8", "--global-batch", "64"], "no training command"),
    (["run", "--micro-batch", "8", "--global-batch", "64", "--"], "no training command"),
    (["run", "--run-dir", "/proc/version/run", "--micro-batch", "8", "--grad-accum", "1", "--",
      "true", "{micro_batch}"],
     "--run-dir: cannot write"),
    (["status", "--run-dir", "/nonexistent/run"], "no oomguard run"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str) -> None:
    out = oomguard(*args)
    assert out.returncode == 2
    assert needle in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    assert "Traceback" not in out.stderr


def test_example_script_hits_a_real_allocator_oom_and_finishes_with_the_same_global_batch(
        run_dir: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    result = oomguard("run", "--run-dir", str(run_dir), *FAST, "--micro-batch", "32", "--global-batch", "64",
                      "--checkpoint", f"{out_dir}/checkpoint-*", "--resume-args", "--resume-from {checkpoint}",
                      "--", PY, str(ROOT / "examples" / "train_argparse.py"), "--batch-size", "{micro_batch}",
                      "--gradient-accumulation-steps", "{grad_accum}", "--output", str(out_dir),
                      "--memory-budget-mb", "100", timeout=180)
    assert result.returncode == 0, result.stderr
    doc = status(run_dir)
    assert doc["state"] == "succeeded" and doc["global_batch"] == 64
    assert doc["micro_batch"] * doc["grad_accum"] == 64 and doc["micro_batch"] < 32
    assert set(kinds(doc)) == {"host_oom"}
    assert all("DefaultCPUAllocator: can't allocate memory" in f["evidence"] for f in doc["failures"])
    assert f"resumed from {out_dir}/checkpoint-4 at step 4" in result.stdout
    assert (out_dir / "checkpoint-12" / "state.pt").exists()
    memory = doc["memory"]
    assert memory is not None
    if memory["gpus"]:  # a machine with GPUs: their figures, and no reason for missing ones
        assert memory["gpu_unavailable"] is None
    else:  # none here (no driver, no NVML): status says why in one line
        assert (memory["gpu_unavailable"] or "").startswith("GPU figures unavailable: "), memory
