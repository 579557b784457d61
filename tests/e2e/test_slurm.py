"""docs/deploy/oomguard.sbatch under a real Slurm (tests/support_slurm.py: slurmctld and two slurmd on
this machine, munge, proctrack/task cgroup, jobs as an unprivileged user).

The file is submitted as it is, ``sbatch docs/deploy/oomguard.sbatch``: its #SBATCH lines are accepted
unchanged (the nodes claim 64 CPUs and 8 GPUs each); what a scenario needs more is given as a user
would, on sbatch's command line (``--mem``, ``--time``, ``--signal``) and in the settings the file
reads from the environment (PROCS_PER_NODE, TRAIN, ...). One Gloo rank per node, real faults.

One job per scenario, one after the other (each takes both nodes, as the file's 64 CPUs a task ask):
  A. a kernel OOM kill of node 1's rank in Slurm's --mem cgroup (tests/workers/ddp_train.py): both
     nodes on the same halved plan; with port 8765 taken on the node (the dashboard moves), every line
     labelled by its node, no control token in the output. Then ``scancel --signal=TERM``, and in the
     requeued run the time limit with --signal=TERM@30: each time exit 143 on both nodes and a requeue;
     the resume is from the newest checkpoint at the micro-batch the OOM settled on; no cgroup of the
     job is left.
  E. a lost node (tests/e2e/lost_node_train.py, elastic ``--nnodes 1:2``): Slurm node 1's oomguard and
     its rank killed (SIGKILL) mid-run: the other node goes on alone at the same global batch (taking
     oomguard's store over where node 1's kept it: both nodes are this machine), node 1's shell starts
     its oomguard again and it is taken in at the next checkpoint; every optimizer step (the script's
     own records) trained on the global batch asked; the job ends COMPLETED.
  C. cgroup v2: the scenarios run under the cgroup version this machine mounts; where that is v1, the
     test says why Slurm's cgroup/v2 cannot run here.
"""

from __future__ import annotations

import contextlib
import json
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

import psutil
import pytest
import support_slurm
from support import ROOT

from oomguard.supervisor.record.journal import Journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SBATCH = ROOT / "docs" / "deploy" / "oomguard.sbatch"
SCRIPT = ROOT / "tests" / "workers" / "ddp_train.py"
LOST_NODE_SCRIPT = ROOT / "tests" / "e2e" / "lost_node_train.py"
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


def submit(cluster: support_slurm.Cluster, where: Path, train: str, *options: str, extra: str = "",
           script: Path = SCRIPT) -> str:
    """``sbatch [options] docs/deploy/oomguard.sbatch`` as the job user, the settings in the environment."""
    ck = where / "runs" / "pretrain" / "ck"
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OOMGUARD_CACHE_DIR": str(where / "cache"),
           "PROCS_PER_NODE": "1", "MICRO_BATCH": "4", "GLOBAL_BATCH": "16",
           "TRAIN": f"{script} --micro-batch-size {{micro_batch}} --gradient-accumulation-steps {{grad_accum}} "
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
                     r"× world \d = 16(?:, resuming from (\S+))?$", re.M)


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


def test_a_kernel_oom_in_slurms_mem_cgroup_then_term_and_the_time_limit_requeue_and_resume(
        cluster: support_slurm.Cluster) -> None:
    where = job_dir(cluster, "a")
    with socket.socket() as busy:  # the dashboard's default port, taken on the node
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("0.0.0.0", 8765))
            busy.listen()
        except OSError:
            pass  # someone else holds it: taken all the same
        # run 1: a kernel OOM kill of node 1's rank at micro-batch 4 (step 3) settles the plan at 2
        jid = submit(cluster, where, "--steps 2000 --step-sleep 0.3 --fault touch --fault-at 4:1", "--mem=1500M",
                     "--signal=TERM@30")
        wait_for(lambda: len(started(where, "0")) >= 2 and newest_checkpoint(where) >= 3, 240,
                 "a step at micro-batch 2", cluster, where)
        assert cluster.client("scancel", "--signal=TERM", jid, user=True).returncode == 0  # as a user, or preemption
        wait_for(lambda: job(cluster, jid).get("Restarts") == "1", 90, "scancel's requeue", cluster, where)
    # run 2 ends at its time limit: one minute, the TERM sent 30 s before the end (--signal=TERM@30; Slurm
    # looks at the limits periodically: the TERM comes up to half a minute later)
    assert cluster.client("scontrol", "update", f"JobId={jid}", "TimeLimit=1").returncode == 0
    newest = where / "runs" / "pretrain" / "ck" / f"step-{newest_checkpoint(where)}"
    text = output(where)
    assert "exit status per node: 143 143" in text and "requeueing after exit 143" in text, text[-4000:]
    run1 = [started(where, task) for task in "01"]
    assert run1[0] == run1[1] and run1[0][0][:2] == (4, 2) and run1[0][-1][:2] == (2, 4), run1
    assert "] recovering: attempt 1 ended: host_oom (" in text, text[-4000:]
    # every line of a node's oomguard is labelled (srun --label); the dashboard moved off the taken port
    assert re.search(r"^0: \[oomguard\]", text, re.M) and re.search(r"^1: \[oomguard\]", text, re.M), text
    dashboard = re.search(r"^[01]: \[oomguard\] dashboard: http://\S+ .*\(port 8765 is in use\)", text, re.M)
    assert dashboard is not None, text
    token = (where / "runs" / "pretrain" / "node0" / "token").read_text().strip()
    assert token and token not in text
    wait_for(lambda: job(cluster, jid).get("Restarts") == "2", 150, "the time limit's requeue", cluster, where)
    assert output(where).count("exit status per node: 143 143") == 2, output(where)[-4000:]
    _resumed(cluster, where, len(run1[0]), str(newest))
    cluster.client("scancel", jid, user=True)
    wait_for(ended(cluster, jid), 60, f"job {jid} to end", cluster, where)
    # both nodes adopted one decision: the same halved plan after the OOM, global batch 16
    plans = [[(a["micro_batch"], a["grad_accum"], a["kind"]) for a in attempts(where, n)][:2] for n in (0, 1)]
    assert plans[0][0] == plans[1][0] == (4, 2, "host_oom") and plans[0][1][:2] == plans[1][1][:2] == (2, 4), plans
    wait_for(lambda: not job_cgroups(jid), 30, "Slurm to remove the job's cgroups", cluster, where)


def _resumed(cluster: support_slurm.Cluster, where: Path, before: int, path: str) -> None:
    """Each node's first attempt after run 1, from the newest checkpoint then (``path``), at micro-batch 2.
    In run 2, or in run 3 where the time limit's TERM came before a node's oomguard had started one (on a
    busy machine): no step is taken then, as a round needs both nodes."""

    def firsts() -> list[tuple[int, int, str | None]] | None:
        runs = [started(where, task) for task in "01"]
        return [run[before] for run in runs] if all(len(run) > before for run in runs) else None

    assert wait_for(firsts, 120, "the requeued run", cluster, where) == [(2, 4, path)] * 2


def test_e_a_lost_node_costs_seconds_and_comes_back_within_the_job(cluster: support_slurm.Cluster) -> None:
    where = job_dir(cluster, "e")
    steps = where / "records.jsonl"
    jid = submit(cluster, where, f"--step-sleep 0.2 --records {steps} --until {where / 'until'}",
                 extra="--peer-timeout 60 --grace-period 1", script=LOST_NODE_SCRIPT)

    def records() -> list[dict[str, Any]]:
        return [json.loads(line) for line in steps.read_text().splitlines()] if steps.exists() else []

    def first_after(at: float, world: int) -> dict[str, Any] | None:
        return next((r for r in records() if r["t"] > at and r["world"] == world), None)

    wait_for(lambda: len(records()) >= 2, 150, "two steps of both nodes", cluster, where)
    # Slurm's node 1 is oomguard's node 1, or node 0 where it bound the store's port first (both share this
    # machine, so either may; on a cluster only the rendezvous host's node can): then node 0 takes it over.
    lost = int(re.findall(r"^1: \[oomguard\] node (\d) of 1:2", output(where), re.M)[0])
    killed = _kill_tree(wait_for(lambda: _oomguard_pid(where / "runs" / "pretrain" / "node1"), 30,
                                 "node 1's oomguard", cluster, where))
    first = wait_for(lambda: first_after(killed, 1), 90, "a step on node 0 alone", cluster, where)
    back = wait_for(lambda: first_after(killed, 2), 120, "a step with node 1 back", cluster, where)
    (where / "until").touch()
    wait_for(ended(cluster, jid), 90, f"job {jid} to end", cluster, where)
    text = output(where)
    assert job(cluster, jid)["JobState"] == "COMPLETED", text[-4000:]
    assert "exit status per node: 0 0" in text and "\nfinished" in text, text[-4000:]
    # Every optimizer step the ranks took trained on 16 samples (all-reduced over the ranks): the batch asked.
    done = records()
    assert done and all(s["samples"] == 16 == s["micro"] * s["accum"] * s["world"] for s in done), done
    worlds = [s["world"] for i, s in enumerate(done) if i == 0 or done[i - 1]["world"] != s["world"]]
    assert worlds == [2, 1, 2] and {(s["world"], s["micro"], s["accum"]) for s in done} == {(2, 4, 2), (1, 4, 4)}
    assert "1: node 1: oomguard ended with exit 137; starting it again (1 of 3)" in text, text[-4000:]
    assert f"0: [oomguard] node {lost} lost: its oomguard has not been heard for 10 s" in text, text[-4000:]
    assert re.search(rf"^0: \[oomguard\] round \d+: 1 of 2 nodes \(nodes {1 - lost}\): micro-batch 4 × "
                     r"accumulation 4 × world 1 = 16", text, re.M), text[-4000:]
    assert re.search(r"^0: \[oomguard\] node 2 back: taken in after \S+/ck/step-\d+", text, re.M), text[-4000:]
    wait_for(lambda: not job_cgroups(jid), 30, "Slurm to remove the job's cgroups", cluster, where)
    print(f"\nslurm lost node (oomguard's node {lost}): kill to the first step on the node left "
          f"{first['t'] - killed:.1f} s, to the first step with the node back {back['t'] - killed:.1f} s")


def test_c_cgroup_v2(cluster: support_slurm.Cluster) -> None:
    """The scenarios above ran under the cgroup version this machine mounts; v1 here means Slurm's
    cgroup/v2 cannot run on this machine at all: the skip says why."""
    plugin = re.search(r"^CgroupPlugin=(\S+)", (cluster.root / "etc" / "cgroup.conf").read_text(), re.M)
    assert plugin is not None and plugin.group(1) == f"cgroup/v{support_slurm.cgroup_version()}"
    why = support_slurm.v2_missing()
    if why:
        pytest.skip(why)


def _kill_tree(pid: int) -> float:
    """SIGKILL an oomguard and every process under it (torchrun's agent, the rank) at once: the node lost."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    at = time.time()
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    return at


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
