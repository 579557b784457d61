"""record/memoryparts.py: the journal's ``memory_breakdown`` events as one typed value, and its words
in status, the notification and ``/metrics``, from scripted events in a real journal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from oomguard.supervisor.ops import notify
from oomguard.supervisor.record import memoryparts
from oomguard.supervisor.record.journal import Journal
from oomguard.supervisor.record.status import format_status, status_document
from oomguard.web.metrics import make_registry

GIB = 1 << 30
MIB = 1 << 20


def cuda_oom(attempt: int = 1, rank: int | None = 0, activations: int | None = 14 * GIB, **over: Any) -> dict[str, Any]:
    """A rank's breakdown at a CUDA OOM, in the event's format (docs/outputs.md)."""
    return {"attempt": attempt, "micro_batch": 32, "rank": rank, "at": "oom", "device": "cuda:0",
            "weights": 2 * GIB, "frozen_weights": 0, "gradients": 2 * GIB, "optimizer_state": 4 * GIB,
            "optimizers": ["AdamW"], "activations": activations, "cache": None, "total": 22 * GIB,
            "limit": 24 * GIB, "limit_kind": "gpu", "processes": None, **over}


def kernel_kill(attempt: int = 1) -> dict[str, Any]:
    """A kernel OOM kill: the probe saw nothing at the moment; the last reading per process."""
    return {"attempt": attempt, "micro_batch": 8, "rank": None, "at": "last_reading", "device": "cpu",
            "weights": None, "frozen_weights": None, "gradients": None, "optimizer_state": None,
            "optimizers": [], "activations": None, "cache": None, "total": 900 * MIB, "limit": 1024 * MIB,
            "limit_kind": "cgroup", "processes": [
                {"pid": 10, "role": "trainer", "name": "python", "rss": 600 * MIB},
                {"pid": 11, "role": "data-loader worker", "name": "pt_data_worker", "rss": 200 * MIB},
                {"pid": 12, "role": "data-loader worker", "name": "pt_data_worker", "rss": 100 * MIB}]}


def test_a_cuda_oom_reads_as_its_parts_and_a_part_not_seen_says_so() -> None:
    value = memoryparts.parse(cuda_oom(frozen_weights=GIB, optimizers=["AdamW", "SGD"]))
    assert value is not None
    assert [(p.key, p.bytes) for p in value.parts] == [
        ("weights", 2 * GIB), ("gradients", 2 * GIB), ("optimizer_state", 4 * GIB), ("activations", 14 * GIB),
        ("cache", None)]
    assert memoryparts.line(value) == (
        "attempt 1 at micro-batch 32, rank 0, at the OOM: weights 2.0 GiB (1.0 GiB of them frozen), "
        "gradients 2.0 GiB, optimizer state 4.0 GiB (AdamW, SGD), activations 14.0 GiB, cache not seen; "
        "limit 24.0 GiB (gpu)")


def test_null_and_malformed_figures_stay_unseen_never_guessed() -> None:
    value = memoryparts.parse(cuda_oom(activations=None, gradients=-1, weights=True, limit=None))
    assert value is not None
    assert [p.bytes for p in value.parts] == [None, None, 4 * GIB, None, None]
    assert memoryparts.limit_text(value) == "limit not seen"
    assert memoryparts.parse({**cuda_oom(), "at": "later"}) is None  # not a moment the format knows
    assert memoryparts.parse({k: v for k, v in cuda_oom().items() if k != "attempt"}) is None
    assert memoryparts.parse({k: v for k, v in cuda_oom().items() if k != "attempt"}, attempt=3) is not None


def test_a_kernel_kill_is_told_by_process_with_its_data_loader_workers() -> None:
    value = memoryparts.parse(kernel_kill())
    assert value is not None and value.failed
    assert memoryparts.parts_text(value) == (
        "no part seen; by process: trainer 600.0 MiB, 2 data-loader workers 300.0 MiB; limit 1.0 GiB (cgroup)")


def test_one_bar_per_attempt_from_the_rank_nearest_its_limit(tmp_path: Path) -> None:
    """Two ranks fail at attempt 1 (rank 1 the fuller); attempt 2 fits and reports its peak; status shows
    the failure and the fit, the two a user compares, in two lines."""
    journal = Journal(tmp_path)
    try:
        journal.event(memoryparts.EVENT, 1, **cuda_oom(rank=0, activations=12 * GIB, total=20 * GIB))
        journal.event(memoryparts.EVENT, 1, **cuda_oom(rank=1, activations=14 * GIB, total=22 * GIB))
        journal.event(memoryparts.EVENT, 2, **cuda_oom(attempt=2, at="peak", micro_batch=16, activations=7 * GIB,
                                                       cache=GIB // 2, total=15 * GIB))
        journal.event("attribution", 1, cause="per_sample", summary="x")  # other events are left alone
        bars = memoryparts.bars(journal)
        assert [(b["attempt"], b["at"], b["rank"]) for b in bars] == [(1, "oom", 1), (2, "peak", 0)]
        text = format_status(status_document(journal))
    finally:
        journal.close()
    memory = [line for line in text.splitlines() if line.startswith("memory:")]
    assert memory == [
        "memory:     attempt 1 at micro-batch 32, rank 1, at the OOM: weights 2.0 GiB, gradients 2.0 GiB, "
        "optimizer state 4.0 GiB (AdamW), activations 14.0 GiB, cache not seen; limit 24.0 GiB (gpu)",
        "memory:     attempt 2 at micro-batch 16, rank 0, at its peak (it fit): weights 2.0 GiB, gradients 2.0 GiB, "
        "optimizer state 4.0 GiB (AdamW), activations 7.0 GiB, cache 512.0 MiB; limit 24.0 GiB (gpu)"]


def test_a_run_without_breakdowns_says_nothing_of_them(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    try:
        doc = status_document(journal)
        assert doc["memory_breakdown"] == []
        assert "memory:" not in format_status(doc)
        assert b"oomguard_memory_breakdown" not in generate_latest(make_registry(lambda: journal))
    finally:
        journal.close()


def test_metrics_give_every_rank_of_the_newest_attempt_and_no_sample_for_a_part_not_seen(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    try:
        journal.event(memoryparts.EVENT, 1, **cuda_oom(rank=0))
        journal.event(memoryparts.EVENT, 2, **cuda_oom(attempt=2, rank=0, activations=3 * GIB))
        journal.event(memoryparts.EVENT, 2, **cuda_oom(attempt=2, rank=1, activations=None))
        text = generate_latest(make_registry(lambda: journal)).decode()
    finally:
        journal.close()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("oomguard_memory_breakdown")}
    assert samples['oomguard_memory_breakdown_bytes{at="oom",part="activations",rank="0"}'] == 3 * GIB
    assert samples['oomguard_memory_breakdown_bytes{at="oom",part="weights",rank="1"}'] == 2 * GIB
    assert 'oomguard_memory_breakdown_bytes{at="oom",part="activations",rank="1"}' not in samples  # not seen
    assert not any('part="cache"' in key for key in samples)
    assert samples['oomguard_memory_breakdown_limit_bytes{kind="gpu",rank="1"}'] == 24 * GIB
    assert samples["oomguard_memory_breakdown_attempt"] == 2


def test_the_recovery_notification_says_what_filled_memory_in_one_line() -> None:
    line = notify.memory_line([cuda_oom(rank=0, activations=GIB, total=9 * GIB), cuda_oom(rank=1)])
    assert line == ("rank 1: weights 2.0 GiB, gradients 2.0 GiB, optimizer state 4.0 GiB (AdamW), "
                    "activations 14.0 GiB, cache not seen; limit 24.0 GiB (gpu)")
    note = notify.recovered("run", "cuda_oom", 32, 16, 2, "micro-batch 32 needed ...", line)
    assert note.message.splitlines()[-1] == f"memory: {line}"
    assert notify.memory_line([]) is None
    filled = notify.FailureMemory()  # as the notification hook hears the loop's events
    assert filled.heard("memory_breakdown", cuda_oom(rank=1)) and not filled.heard("decision", {})
    assert filled.heard("memory_breakdown", cuda_oom(attempt=2, at="peak"))  # an attempt that fit: no failure's
    assert filled.take() == line.removeprefix("rank 1: ") and filled.take() is None
    assert "memory:" not in notify.recovered("run", "cuda_oom", 32, 16, 2).message
