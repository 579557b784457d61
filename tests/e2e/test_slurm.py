"""docs/deploy/oomguard.sbatch under a real Slurm (tests/support_slurm.py: slurmctld and two slurmd on
this machine, munge, proctrack/task cgroup, jobs as an unprivileged user).

The file is submitted as it is, ``sbatch docs/deploy/oomguard.sbatch``: its #SBATCH lines are accepted
unchanged (the nodes claim 64 CPUs and 8 GPUs each); what a scenario needs more is given as a user
would, on sbatch's command line (``--mem``, ``--time``, ``--signal``) and in the settings the file
reads from the environment (PROCS_PER_NODE, TRAIN, ...). The training is tests/workers/ddp_train.py,
one Gloo rank per node, with real faults: a kernel OOM kill in Slurm's own ``--mem`` cgroup, a real
RLIMIT_AS allocator failure.

One job per scenario, one after the other (each takes both nodes, as the file's 64 CPUs a task ask):
  A. a kernel OOM kill of node 1's rank in Slurm's --mem cgroup: both nodes on the same halved plan,
     the global batch kept, the job COMPLETED; with port 8765 taken on the node (the dashboard moves),
     every line labelled by its node, no control token in the output, no cgroup of the job left.
  B. ``scancel --signal=TERM``, then the time limit with --signal=TERM@30: each time exit 143 on both
     nodes and a requeue; the resume is from the newest checkpoint at the micro-batch an OOM settled on.
  E. a lost node: node 1's oomguard killed (SIGKILL): node 0 exits 75, the job is requeued and
     resumes from the newest checkpoint; no cgroup of the job is left once it ends.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import support_slurm
from support import ROOT

from oomguard.supervisor.record.journal import Journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SBATCH = ROOT / "docs" / "deploy" / "oomguard.sbatch"
SCRIPT = ROOT / "tests" / "workers" / "ddp_train.py"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster() -> Iterator[support_slurm.Cluster]:
    why = support_slurm.missing()
    if why:
        pytest.skip(why)
    # not under pytest's temporary directory, which only root may enter: the job user reads the configuration
    root = Path(tempfile.mkdtemp(prefix="oomguard-slurm-"))
    try:
        started = support_slurm.start(root, [Path(sys.executable), ROOT])
    except (RuntimeError, OSError) as exc:
        if not os.environ.get("OOMGUARD_KEEP_SLURM"):  # set: the files stay, to read after a failure
            shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"Slurm did not start here: {exc}")
    try:
        yield started
    finally:
        for jid in started.client("squeue", "-h", "-o", "%i").stdout.split():
            started.client("scancel", jid)
        support_slurm.stop(started)
        if not os.environ.get("OOMGUARD_KEEP_SLURM"):  # set: the files stay, to read after a failure
            shutil.rmtree(root, ignore_errors=True)


def job_dir(cluster: support_slurm.Cluster, name: str) -> Path:
    """The submit directory, the job user's: the output file and runs/ land there."""
    path = cluster.root / "jobs" / name
    path.mkdir(parents=True)
    os.chown(path, cluster.user.pw_uid, cluster.user.pw_gid)
    return path


def submit(cluster: support_slurm.Cluster, where: Path, train: str, *options: str, extra: str = "") -> str:
    """``sbatch [options] docs/deploy/oomguard.sbatch`` as the job user, the settings in the environment."""
    ck = where / "runs" / "pretrain" / "ck"
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OOMGUARD_CACHE_DIR": str(where / "cache"),
           "PROCS_PER_NODE": "1", "MICRO_BATCH": "4", "GLOBAL_BATCH": "16",
           "TRAIN": f"{SCRIPT} --micro-batch-size {{micro_batch}} --gradient-accumulation-steps {{grad_accum}} "
                    f"--ckpt-dir {ck} {train}",
           "CHECKPOINTS": f"{ck}/step-*", "RESUME_ARGS": "--resume-from {checkpoint}",
           "OOMGUARD_ARGS": f"--backoff 0.05 --grace-period 3 --no-spare {extra}".strip()}
    out = cluster.client("sbatch", "--parsable", *options, str(SBATCH), user=True, env=env, cwd=where)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job(cluster: support_slurm.Cluster, jid: str) -> dict[str, str]:
    out = cluster.client("scontrol", "-o", "show", "job", jid)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_for(ready: Callable[[], Any], seconds: float, what: str, cluster: support_slurm.Cluster,
             where: Path) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = ready()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{output(where)[-4000:]}\n{cluster.logs()}")


def output(where: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in where.glob("pretrain-*.out"))


def attempts(where: Path, node: int) -> list[dict[str, Any]]:
    """A node's attempts, from its journal: read once the job has ended."""
    return Journal(where / "runs" / "pretrain" / f"node{node}", readonly=True).attempts()


RUNNING = re.compile(r"^([01]): \[oomguard\] running: attempt (\d+): micro-batch (\d+) × accumulation (\d+) "
                     r"× world 2 = 16(?:, resuming from (\S+))?$", re.M)


def started(where: Path, task: str) -> list[tuple[int, int, str | None]]:
    """Each attempt a node's oomguard started, from the job's output (micro-batch, accumulation, the
    checkpoint resumed from): live runs are read there, not in the journals, which the job user's
    oomguard owns and writes (a root reader of a live SQLite journal could leave files it cannot write)."""
    return [(int(m[2]), int(m[3]), m[4]) for m in RUNNING.findall(output(where)) if m[0] == task]


def newest_checkpoint(where: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in (where / "runs" / "pretrain" / "ck").glob("step-*")]
    return max(steps, default=0)


def job_cgroups(jid: str) -> list[Path]:
    return [p for p in Path("/sys/fs/cgroup").glob(f"*/slurm_n*/uid_*/job_{jid}") if p.exists()]


def ended(cluster: support_slurm.Cluster, jid: str) -> Callable[[], bool]:
    return lambda: job(cluster, jid).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


def test_a_kernel_oom_in_slurms_mem_cgroup_is_recovered_in_the_job_on_both_nodes(
        cluster: support_slurm.Cluster) -> None:
    where = job_dir(cluster, "a")
    with socket.socket() as busy:  # the dashboard's default port, taken on the node
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("0.0.0.0", 8765))
            busy.listen()
        except OSError:
            pass  # someone else holds it: taken all the same
        jid = submit(cluster, where, "--steps 4 --fault touch --fault-at 4:1", "--mem=1500M")
        wait_for(ended(cluster, jid), 240, f"job {jid} to end", cluster, where)
    text = output(where)
    assert job(cluster, jid)["JobState"] == "COMPLETED", text[-4000:]
    assert "exit status per node: 0 0" in text and "\nfinished" in text, text[-4000:]
    # both nodes adopted one decision: the same halved plan, from the same checkpoint, global batch 16
    plans = [[(a["micro_batch"], a["grad_accum"], a["kind"]) for a in attempts(where, n)] for n in (0, 1)]
    assert plans[0] == plans[1] == [(4, 2, "host_oom"), (2, 4, None)], plans
    # every line of a node's oomguard is labelled (srun --label); the dashboard moved off the taken port
    assert re.search(r"^0: \[oomguard\]", text, re.M) and re.search(r"^1: \[oomguard\]", text, re.M), text
    dashboard = re.search(r"^[01]: \[oomguard\] dashboard: http://\S+ .*\(port 8765 is in use\)", text, re.M)
    assert dashboard is not None, text
    token = (where / "runs" / "pretrain" / "node0" / "token").read_text().strip()
    assert token and token not in text
    wait_for(lambda: not job_cgroups(jid), 30, "Slurm to remove the job's cgroups", cluster, where)


def test_b_scancel_term_and_the_time_limit_requeue_and_resume_at_the_settled_micro_batch(
        cluster: support_slurm.Cluster) -> None:
    where = job_dir(cluster, "b")
    # run 1: an allocator OOM (RLIMIT_AS) on node 0's rank at micro-batch 4 (step 3) settles the plan at 2
    jid = submit(cluster, where, "--steps 2000 --step-sleep 0.3 --fault rlimit --fault-at 4:0", "--signal=TERM@30")
    wait_for(lambda: len(started(where, "0")) >= 2 and newest_checkpoint(where) >= 4, 240,
             "two steps at micro-batch 2", cluster, where)
    assert cluster.client("scancel", "--signal=TERM", jid, user=True).returncode == 0  # as a user, or preemption
    wait_for(lambda: job(cluster, jid).get("Restarts") == "1", 90, "scancel's requeue", cluster, where)
    # run 2 ends at its time limit: two minutes (Slurm sends --signal's TERM up to a minute early, and the
    # first attempt must start before it), the TERM sent 30 s before the end (--signal=TERM@30)
    assert cluster.client("scontrol", "update", f"JobId={jid}", "TimeLimit=2").returncode == 0
    text = output(where)
    assert "exit status per node: 143 143" in text and "requeueing after exit 143" in text, text[-4000:]
    run1 = started(where, "0")
    assert run1[0][0] == 4 and run1[-1][:2] == (2, 4) and "] recovering: attempt 1 ended: host_oom (" in text, run1
    _resumed(cluster, where, len(run1))
    wait_for(lambda: job(cluster, jid).get("Restarts") == "2", 180, "the time limit's requeue", cluster, where)
    assert output(where).count("exit status per node: 143 143") == 2, output(where)[-4000:]
    cluster.client("scancel", jid, user=True)
    wait_for(ended(cluster, jid), 60, f"job {jid} to end", cluster, where)
    wait_for(lambda: not job_cgroups(jid), 30, "Slurm to remove the job's cgroups", cluster, where)


def _resumed(cluster: support_slurm.Cluster, where: Path, before: int) -> int:
    """The requeued job's first attempt, on both nodes: from the newest checkpoint, at micro-batch 2."""
    newest = newest_checkpoint(where)
    path = str(where / "runs" / "pretrain" / "ck" / f"step-{newest}")

    def firsts() -> list[tuple[int, int, str | None]] | None:
        runs = [started(where, task) for task in "01"]
        return [run[before] for run in runs] if all(len(run) > before for run in runs) else None

    assert wait_for(firsts, 120, "the requeued run", cluster, where) == [(2, 4, path)] * 2
    return newest


def test_e_a_lost_node_requeues_the_job(cluster: support_slurm.Cluster) -> None:
    where = job_dir(cluster, "e")
    jid = submit(cluster, where, "--steps 2000 --step-sleep 0.3", extra="--peer-timeout 15")
    wait_for(lambda: newest_checkpoint(where) >= 2, 150, "step 2's checkpoint", cluster, where)
    pid = wait_for(lambda: _oomguard_pid(where / "runs" / "pretrain" / "node1"), 30, "node 1's oomguard",
                   cluster, where)
    os.kill(pid, signal.SIGKILL)  # node 1 lost: its oomguard and (its launcher ends them) its ranks
    wait_for(lambda: job(cluster, jid).get("Restarts") == "1", 120, "the lost node's requeue", cluster, where)
    text = output(where)
    assert "exit status per node: 75 137" in text and "requeueing after exit 75" in text, text[-4000:]
    _resumed_any(cluster, where)
    cluster.client("scancel", jid, user=True)
    wait_for(ended(cluster, jid), 60, f"job {jid} to end", cluster, where)
    wait_for(lambda: not job_cgroups(jid), 30, "Slurm to remove the job's cgroups", cluster, where)


def _resumed_any(cluster: support_slurm.Cluster, where: Path) -> None:
    before = len(started(where, "0"))
    newest = newest_checkpoint(where)
    first = wait_for(lambda: a[before] if len(a := started(where, "0")) > before else None, 120,
                     "the requeued run", cluster, where)
    assert first == (4, 2, str(where / "runs" / "pretrain" / "ck" / f"step-{newest}")), first


def _oomguard_pid(run_dir: Path) -> int | None:
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and b"run" in argv and str(run_dir).encode() in argv and \
                any(a.endswith(b"oomguard") for a in argv[:2]):
            return int(proc.name)
    return None
