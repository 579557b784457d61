"""Session under DDP: two real Gloo ranks (CPU), a real allocator OOM on rank 0 only.

Without agreement rank 1 would wait in the gradient all-reduce for a rank that is retrying: a
hang. With it both ranks learn of the OOM at the same all-reduced flag and redo the step at the
same smaller micro-batch, and the result equals a run at that size from the start.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RANK = Path(__file__).resolve().parent / "workers" / "ddp_session.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_oom_on_one_rank_is_redone_by_every_rank_at_the_same_size() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(RANK)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in ranks]  # a hang would end here, as a failure
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    # Step 2 is redone on both ranks at micro-batch 4 (one OOM absorbed each: rank 0's own, rank 1's peer's).
    for result in results:
        assert [tuple(s) for s in result["steps"]] == [(8, 0), (4, 1), (4, 0)]
        assert result["diff_vs_micro_4"] < 1e-5
        assert result["ranks_equal"]
