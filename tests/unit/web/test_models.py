"""web/models.py: the API's Status model is the status document's schema, key for key."""

from __future__ import annotations

import time
from pathlib import Path

from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.status import status_document
from oomguard.web import models

PLAN = {"micro_batch": 8, "grad_accum": 2, "global_batch": 16, "world_size": 1}


def test_the_status_document_is_what_the_status_model_describes(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.set_meta(state="running", reason="attempt 2", attempt=2, plan=PLAN, config={"command": ["train.py"]})
    journal.start_attempt(1, 10, PLAN, None, ["train.py"], "log1")
    journal.end_attempt(1, kind="cuda_oom", evidence="CUDA out of memory", decision="shrink", ending="failed",
                        exit_code=1, peak_allocated=2**30)
    journal.event("attribution", 1, summary="per-sample", figures={"slope": 0.0})
    journal.start_attempt(2, 11, PLAN, None, ["train.py"], "log2")
    journal.checkpoint_seen("/ck/step-10.pt", 10, time.time(), 2)
    journal.record_sample(2, {"worker_rss_bytes": 2**20}, time.time(), 2**20, None, 10, {"step": 10})
    doc = status_document(journal)
    journal.close()
    assert set(doc) == set(models.Status.model_fields)
    assert set(doc["failures"][0]) == set(models.FailureView.model_fields)
    valid = models.Status.model_validate(doc)
    assert valid.failures[0].cause == {"summary": "per-sample", "figures": {"slope": 0.0}}
    assert valid.newest_checkpoint is not None and valid.newest_checkpoint.step == 10
