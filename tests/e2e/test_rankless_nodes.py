"""Two nodes on this machine in PyTorch's own multi-node form: the same torchrun line on both, no node
rank (``--rdzv_backend c10d --rdzv_endpoint localhost:PORT``), each node's oomguard in a memory cgroup
of its own, one Gloo rank per node.

Which oomguard keeps the shared decision is settled as c10d settles which node hosts its store: the
endpoint's host is this machine for both, so the first to bind is node 0 and the other joins as node 1.
Round 1: the kernel OOM killer kills node 1's rank (a node that joined the store); round 2: node 0's
rank (the store's own node). After each, both nodes must restart at the same halved plan from the
same checkpoint, and the run finishes on both.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT, WORKERS, MemoryCgroups, free_port_pair

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
SCRIPT = str(WORKERS / "ddp_train.py")
TORCHRUN = str(Path(PY).parent / "torchrun")


def start_node(n: int, tmp: Path, port: int, cgroup: Path) -> subprocess.Popen[str]:
    """The docs' form (docs/multinode.md): oomguard's options, then the torchrun line every node runs."""
    argv = [PY, "-m", "oomguard", "run", "--run-dir", str(tmp / f"node{n}"), "--no-web", "--backoff", "0.05",
            "--peer-timeout", "60", "--grace-period", "3", "--micro-batch", "4", "--global-batch", "16",
            "--checkpoint", f"{tmp}/ck/step-*", "--resume-args", "--resume-from {checkpoint}", "--",
            TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_id", "456", "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"localhost:{port}",
            SCRIPT, "--micro-batch-size", "{micro_batch}", "--gradient-accumulation-steps", "{grad_accum}",
            "--ckpt-dir", str(tmp / "ck"), "--steps", "4", "--fault", "touch", "--fault-at", "4:1,2:0"]
    joined = " ".join(f"'{a}'" for a in argv)
    out = open(tmp / f"node{n}.out", "w")  # the child writes it; closed when collected
    return subprocess.Popen(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {joined}"], stdout=out,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_rankless_nodes_recover_a_kernel_oom_kill_on_either_node(tmp_path: Path,
                                                                  memory_cgroup: MemoryCgroups) -> None:
    port = free_port_pair()
    # 1.2 GiB a node: oomguard, torchrun's agent and one rank (about 0.7 GiB together)
    nodes = [start_node(n, tmp_path, port, memory_cgroup(1200 * 2**20, name=f"oomguard-node{n}")) for n in (0, 1)]
    started = time.monotonic()
    try:
        codes = [node.wait(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    outs = [(tmp_path / f"node{n}.out").read_text() for n in (0, 1)]
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    # Each process learned which node it is: one hosts the store, the other joined it.
    numbers = sorted(int(re.search(r"\[oomguard\] node (\d) of 2", out).group(1)) for out in outs)  # type: ignore[union-attr]
    assert numbers == [0, 1]
    # Every round, the same plan from the same checkpoint on both nodes.
    journals = [Journal(tmp_path / f"node{n}", readonly=True).attempts() for n in (0, 1)]
    rounds = [[(a["micro_batch"], a["grad_accum"], a["checkpoint"]) for a in j] for j in journals]
    step2 = str(tmp_path / "ck" / "step-2")
    assert rounds[0] == rounds[1] == [(4, 2, None), (2, 4, step2), (1, 8, step2)]
    # Each node journals node 0's resume point with the evidence of its step, which was null
    # before that evidence travelled with the agreed checkpoint. Which evidence depends on where the
    # rank-less rendezvous put global rank 0, the writer: its node saw the save, the other the name.
    resumed = [[(e["data"]["step"], e["data"]["step_from"]) for e in Journal(tmp_path / f"node{n}", readonly=True)
                .events() if e["kind"] == "resume_point"] for n in (0, 1)]
    assert resumed[0] == resumed[1] and len(resumed[0]) == 2, resumed
    assert all(step == 2 and source in ("save", "name") for step, source in resumed[0]), resumed
    # Round 1 was node 1's rank, round 2 node 0's (the store's node), each killed by the kernel.
    for j in journals:
        assert [a["kind"] for a in j] == ["host_oom", "host_oom", None]
        assert j[0]["evidence"].startswith("node 1: rank ") and j[1]["evidence"].startswith("node 0: rank ")
        assert all("killed by the kernel OOM killer" in a["evidence"] for a in j[:2])
    print(f"\nrank-less nodes: {time.monotonic() - started:.1f} s for 3 rounds")
    for r, (a0, a1) in enumerate(zip(*journals, strict=True), 1):
        print(f"  round {r}: micro {a0['micro_batch']} × accum {a0['grad_accum']} × world 2 from "
              f"{a0['checkpoint'] or 'scratch'}; {a0['kind'] or 'finished'}: {(a0['evidence'] or '')[:90]}; "
              f"{a0['ended'] - a0['started']:.1f} s (node 0), {a1['ended'] - a1['started']:.1f} s (node 1)")
    faults = [float(t) for out in outs for t in re.findall(r"fault touch at ([\d.]+)", out)]
    ready = sorted(float(t) for out in outs for t in re.findall(r"ready ([\d.]+)", out))
    for fault in sorted(faults):
        back = [t for t in ready if t > fault][:2]
        print(f"  fault at {fault:.2f}: both ranks past the rendezvous again {max(back) - fault:.1f} s later")
