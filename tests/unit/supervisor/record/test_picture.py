"""record/picture.py: the typed picture of a run, and old journals read as new ones."""

from __future__ import annotations

import shutil
import signal
import sqlite3
from pathlib import Path

from oomguard.supervisor.lifecycle import Ending, StopReason
from oomguard.supervisor.record.journal import Journal, journal_path
from oomguard.supervisor.record.picture import closing, read_picture, stopped_by
from oomguard.supervisor.record.report import build_report

PLAN = {"micro_batch": 8, "grad_accum": 2, "global_batch": 16, "world_size": 1}
BREAKDOWN = {"attempt": 1, "micro_batch": 8, "rank": 0, "at": "oom", "device": "cuda:0", "weights": 400,
             "frozen_weights": 0, "gradients": 400, "optimizer_state": 800, "optimizers": ["AdamW"],
             "activations": 1200, "cache": 64, "total": 2864, "limit": 3000, "limit_kind": "gpu", "processes": None}
# Each ending as the current loop writes it: the decision's words and the structured columns.
ENDINGS = [
    ({"kind": "cuda_oom", "decision": "halve the micro-batch to 4", "ending": "failed", "exit_code": 1}),
    ({"kind": "hang", "decision": "restart: no progress for 600 s", "ending": "hang"}),
    ({"decision": "grow: micro-batch 8 fits, up to 16", "ending": "grow", "stop_reason": StopReason.GROW.value}),
    ({"decision": "planned restart: the memory trend reaches the limit", "ending": "planned_restart",
      "stop_reason": StopReason.PLANNED.value}),
    ({"decision": stopped_by(signal.SIGINT), "ending": "stopped", "stop_reason": StopReason.USER.value}),
    ({"decision": closing(None).decision, "ending": closing(None).ending.value}),
    ({"decision": "finished", "ending": "finished", "exit_code": 0}),
]


def _journal(run_dir: Path) -> None:
    journal = Journal(run_dir)
    journal.set_meta(state="running", reason="attempt 8", attempt=8, plan=PLAN)
    for n, facts in enumerate(ENDINGS, start=1):
        journal.start_attempt(n, 100 + n, PLAN, None, ["train.py"], f"log{n}")
        journal.end_attempt(n, **facts)
    journal.start_attempt(8, 108, PLAN, None, ["train.py"], "log8")
    journal.event("memory_breakdown", 1, **BREAKDOWN)
    journal.event("memory_breakdown", 1, **{**BREAKDOWN, "rank": 1})
    journal.close()


def test_an_old_journal_reads_as_the_current_one_wrote_it(tmp_path: Path) -> None:
    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir()
    _journal(new)
    shutil.copytree(new, old)
    with sqlite3.connect(journal_path(old)) as db:  # as written before the columns existed
        db.execute("UPDATE attempts SET ending = NULL, stop_reason = NULL")
    pictures = []
    for run_dir in (new, old):
        journal = Journal(run_dir, readonly=True)
        pictures.append(read_picture(journal))
        journal.close()
    endings = [a.ending for a in pictures[0].attempts]
    assert endings == [Ending.FAILED, Ending.HANG, Ending.GROW, Ending.PLANNED_RESTART, Ending.STOPPED,
                       Ending.INTERRUPTED, Ending.FINISHED, None]
    assert [a.ending for a in pictures[1].attempts] == endings
    assert [a.number for a in pictures[1].failures] == [1, 2]


def test_failures_breakdowns_and_the_report_read_the_same_picture(tmp_path: Path) -> None:
    _journal(tmp_path)
    journal = Journal(tmp_path, readonly=True)
    picture, report = read_picture(journal), build_report(journal)
    journal.close()
    first = picture.attempts[0]
    assert first.failed and first.exit == "exit 1" and len(first.breakdowns) == 2
    assert first.breakdowns[1].rank == 1 and first.breakdowns[0].optimizers == ("AdamW",)
    parts = {part.key: part.bytes for part in first.breakdowns[0].parts}
    assert (parts["activations"], first.breakdowns[0].limit_kind) == (1200, "gpu")
    assert not any(a.breakdowns for a in picture.attempts[1:])
    # The report's failures: the picture's, and the interrupted attempt another followed.
    assert [f["attempt"] for f in report["failures"]] == [1, 2, 6]
    assert [s["attempt"] for s in report["stops"]] == [5]
    assert [r["attempt"] for r in report["planned_restarts"]] == [4]
