"""One real run meets every out-of-memory form of tests/data/oom_corpus.jsonl and halves after each memory
failure (the corpus through both classifiers is in tests/unit/common/test_oomtexts.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from support import ROOT, oomguard, status

CORPUS = ROOT / "tests" / "data" / "oom_corpus.jsonl"


RECORDS: list[dict[str, Any]] = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


WORKER = str(ROOT / "tests" / "workers" / "oom_corpus.py")


def test_one_run_meets_every_form_and_halves_after_each_memory_failure(tmp_path: Path) -> None:
    """End to end: attempt N of one ``oomguard run`` dies of record N; each memory failure halves the
    micro-batch, the crash restarts at the same size, and the attempt after the last record finishes."""
    memory = sum(1 for r in RECORDS if r["kind"] != "crash")
    start = 2 ** memory
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), "--no-web", "--backoff", "0.05", "--max-backoff", "0.2",
                   "--micro-batch", str(start), "--global-batch", str(start), "--",
                   sys.executable, WORKER, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = status(tmp_path / "run")
    failures = doc["failures"]
    assert [f["kind"] for f in failures] == [r["kind"] for r in RECORDS]
    micro = start
    for record, failure in zip(RECORDS, failures, strict=True):
        assert failure["micro_batch"] == micro, record["id"]
        assert failure["exit_code"] == 1 and failure["signal"] is None, record["id"]
        if record["kind"] != "crash":
            assert failure["evidence"] == record["evidence"], record["id"]
            micro //= 2  # halved: never a crash restart at the same size
        else:
            assert record["output"][-1] in failure["evidence"]
    assert doc["state"] == "succeeded" and doc["micro_batch"] == micro == 1
    assert f"worker attempt={len(RECORDS) + 1} micro=1" in out.stdout
