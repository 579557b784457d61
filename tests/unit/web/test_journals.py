"""web/journals.py: the per-thread read-only connections never serve an old snapshot; the chart's pure
helpers (sample normalisation, peak-keeping downsampling, markers)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from oomguard.supervisor.record.journal import Journal
from oomguard.web.journals import JournalPool, attempt_markers, chart_point, downsample

PLAN = {"micro_batch": 4, "grad_accum": 1, "global_batch": 4, "world_size": 1}


def _sample(journal: Journal, step: int) -> None:
    journal.record_sample(1, {"worker_rss_bytes": step}, time.time(), step, None, step, {"step": step})


def test_a_statement_left_open_does_not_freeze_what_the_pool_serves(tmp_path: Path) -> None:
    writer = Journal(tmp_path)
    writer.start_attempt(1, 1, PLAN, None, ["train.py"], "log")
    _sample(writer, 99)
    _sample(writer, 100)
    pool = JournalPool(tmp_path)
    try:
        # A read that leaves its statement open (a cursor not exhausted: one row of two taken):
        # under WAL the connection stays in that read transaction and sees the journal as it was.
        left_open = pool.get()._db.execute("SELECT id FROM samples")
        assert left_open.fetchone() is not None
        _sample(writer, 101)
        assert pool.get().latest_samples(1)[0]["worker_rss_bytes"] == 101
        assert pool.get().meta()["progress"]["step"] == 101
        _sample(writer, 102)  # the replacement keeps up as well
        assert pool.get().latest_samples(1)[0]["worker_rss_bytes"] == 102
    finally:
        pool.close()
        writer.close()


def test_a_connection_that_keeps_up_is_kept(tmp_path: Path) -> None:
    writer = Journal(tmp_path)
    writer.start_attempt(1, 1, PLAN, None, ["train.py"], "log")
    pool = JournalPool(tmp_path)
    try:
        first = pool.get()
        for step in range(3):
            _sample(writer, step)
            assert pool.get().latest_samples(1)[0]["worker_rss_bytes"] == step
        assert pool.get() is first
    finally:
        pool.close()
        writer.close()


def _point(t: float, rss: int, attempt: int = 1) -> dict[str, Any]:
    return chart_point({"t": t, "attempt": attempt, "rss": rss})


def test_chart_point_reads_old_and_new_sample_rows() -> None:
    assert chart_point({"t": 1, "attempt": 1, "rss": 5, "cgroup_usage": 7}) == {
        "t": 1.0, "attempt": 1, "host_rss": 5, "cgroup_usage": 7, "gpu": {}}
    row = {"t": 2, "attempt": 1, "worker_rss_bytes": 9, "gpu_used_bytes": 3}
    assert chart_point(row)["gpu"] == {"0": 3} and chart_point(row)["host_rss"] == 9
    per_device = {"t": 3, "gpus": [{"cuda_index": 0, "used_bytes": 10}, {"cuda_index": 1, "used_bytes": 20}]}
    assert chart_point(per_device)["gpu"] == {"0": 10, "1": 20}


def test_downsample_keeps_the_spike_and_the_newest_point() -> None:
    points = [_point(i, 100) for i in range(10_000)]
    points[4321] = _point(4321, 10**9)
    out = downsample(points, 300)
    assert len(out) <= 300
    assert any(p["host_rss"] == 10**9 for p in out)
    assert out[-1]["t"] == 9999 and out[0]["t"] == 0


def test_downsample_keeps_the_last_sample_of_each_attempt() -> None:
    points = [_point(i, i, attempt=1 + i // 1000) for i in range(5000)]
    out = downsample(points, 100)
    assert len(out) <= 100
    assert {999, 1999, 2999, 3999, 4999} <= {p["t"] for p in out}


def test_attempt_markers() -> None:
    attempts = [
        {"attempt": 1, "started": 1.0, "ended": 2.0, "micro_batch": 8, "grad_accum": 1, "kind": "cuda_oom",
         "evidence": "CUDA out of memory"},
        {"attempt": 2, "started": 2.1, "ended": 3.0, "micro_batch": 4, "grad_accum": 2, "kind": "crash",
         "evidence": "exit 1"},
        {"attempt": 3, "started": 4.0, "ended": None, "micro_batch": 4, "grad_accum": 2, "kind": None},
    ]
    kinds = [(m["kind"], m["t"]) for m in attempt_markers(attempts)]
    assert kinds == [("oom", 2.0), ("restart", 2.1), ("batch", 2.1), ("failure", 3.0), ("restart", 4.0)]
