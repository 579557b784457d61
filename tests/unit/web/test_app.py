"""web/app.py: /api/status is validated by the status document's one schema (record/status.StatusDoc)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pydantic
import pytest

from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.status import status_document
from oomguard.web.app import STATUS

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
    valid = STATUS.validate_python(doc)  # what /api/status does before it answers
    assert json.loads(STATUS.dump_json(valid)) == json.loads(json.dumps(doc))
    assert valid.failures[0].cause == {"summary": "per-sample", "figures": {"slope": 0.0}}
    assert valid.newest_checkpoint is not None and valid.newest_checkpoint["step"] == 10
    schema = STATUS.json_schema()  # the OpenAPI schema /api/status is documented with
    assert {"state", "failures", "newest_checkpoint", "progress"} <= set(schema["properties"])


def test_a_document_that_breaks_the_schema_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError):
        STATUS.validate_python({"state": "running"})
