"""web/journals.py: the per-thread read-only connections never serve an old snapshot."""

from __future__ import annotations

import time
from pathlib import Path

from oomguard.supervisor.record.journal import Journal
from oomguard.web.journals import JournalPool

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
