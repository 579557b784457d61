"""Two nodes on this machine: two `oomguard run --nnodes 2` processes, torchrun's c10d rendezvous on
localhost, one Gloo rank each; oomguard's rounds shared through node 0's TCPStore.

Round 1: node 1's rank hits a real allocator OOM (RLIMIT_AS). Both nodes must start round 2 at
the same halved plan from the same checkpoint. Round 2: node 1's oomguard is killed with SIGKILL;
node 0 must end with exit code 75 and one line, and no process of either node may be left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from support import ROOT, WORKERS, free_port_pair

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
SCRIPT = str(WORKERS / "ddp_train.py")


def start_node(node: int, tmp: Path, port: int) -> subprocess.Popen[str]:
    argv = [PY, "-m", "oomguard", "run", "--run-dir", str(tmp / f"node{node}"), "--no-web", "--backoff", "0.05",
            "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"localhost:{port}",
            "--peer-timeout", "10", "--grace-period", "3", "--micro-batch", "4", "--global-batch", "16",
            "--checkpoint", f"{tmp}/ck/step-*", "--resume-args", "--resume-from {checkpoint}", "--",
            PY, SCRIPT, "--micro-batch-size", "{micro_batch}", "--gradient-accumulation-steps", "{grad_accum}",
            "--ckpt-dir", str(tmp / "ck"), "--steps", "400", "--step-sleep", "0.1", "--fault", "rlimit",
            "--fault-node", "1"]
    out = open(tmp / f"node{node}.out", "w")  # the child writes it; closed when collected
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_for(predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def rounds(run_dir: Path) -> list[tuple[int, int, str | None]]:
    return [(a["micro_batch"], a["grad_accum"], a["checkpoint"]) for a in Journal(run_dir, readonly=True).attempts()]


def test_two_nodes_share_every_round_and_a_lost_node_ends_the_other(tmp_path: Path) -> None:
    port = free_port_pair()
    nodes = [start_node(0, tmp_path, port), start_node(1, tmp_path, port)]
    tree: set[int] = set()
    try:
        # Round 2 runs on both nodes (both ranks printed their start) ...
        # (a generous deadline: on a loaded 2-core machine two torchruns took 37 s to start their ranks and
        # longer to tear down after the fault, past the 120 s this waited before)
        wait_for(lambda: all("attempt 2 micro" in (tmp_path / f"node{n}.out").read_text() for n in (0, 1)), 300)
        for proc in nodes:
            tree |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        # ... when node 1's oomguard is killed outright.
        os.kill(nodes[1].pid, signal.SIGKILL)
        assert nodes[0].wait(timeout=60) == 75
    finally:
        for proc in nodes:
            proc.kill()
            proc.wait()
    out0 = (tmp_path / "node0.out").read_text()
    lost = [line for line in out0.splitlines() if line.startswith("[oomguard] failed:")]
    assert len(lost) == 1 and "node 1" in lost[0], out0[-3000:]
    # Every round both nodes ran: the same plan from the same checkpoint.
    r0, r1 = rounds(tmp_path / "node0"), rounds(tmp_path / "node1")
    assert r0 == r1 == [(4, 2, None), (2, 4, str(tmp_path / "ck" / "step-2"))]
    print(f"\nrounds both nodes agreed on: {sum(a == b for a, b in zip(r0, r1, strict=True))}")
    journal = Journal(tmp_path / "node0", readonly=True)
    first = journal.attempts()[0]
    # c10d hands out global ranks in order of arrival: node 1's rank may be rank 0 or 1
    assert first["kind"] == "host_oom" and first["evidence"].startswith("node 1: rank ")
    assert "DefaultCPUAllocator: can't allocate memory" in first["evidence"]
    # Nothing left of either node: ranks, torchrun agents and launchers are gone (reaped as their
    # parents notice, which a loaded machine may take a while over).
    def alive() -> list[int]:
        return [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]

    try:
        wait_for(lambda: not alive(), timeout=30)
    except AssertionError:
        raise AssertionError([psutil.Process(p).cmdline() for p in alive()]) from None
