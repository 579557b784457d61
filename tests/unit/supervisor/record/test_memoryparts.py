"""record/memoryparts.py: the journal's ``memory_breakdown`` events as one typed value, and its words
in status, the notification and ``/metrics``, from scripted events in a real journal; the comparison's
words, the no-room verdict, and what observe/allocator.py journals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from oomguard.supervisor.observe.allocator import EVENT, BreakdownWatch, LastReading
from oomguard.supervisor.observe.cgroup import CgroupMemory
from oomguard.supervisor.observe.sampler import MemorySample
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
        doc = status_document(journal)
        bars = doc["memory_breakdown"]
        assert [(b["attempt"], b["at"], b["rank"]) for b in bars] == [(1, "oom", 1), (2, "peak", 0)]
        text = format_status(doc)
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



def event(attempt: int, micro: int, at: str, activations: int, **more: Any) -> memoryparts.MemoryBreakdown:
    value = memoryparts.parse({"attempt": attempt, "micro_batch": micro, "at": at, "rank": 0, "device": "cuda:0",
                               "weights": GIB // 2, "frozen_weights": 0, "gradients": GIB // 2,
                               "optimizer_state": GIB, "optimizers": ["AdamW"], "activations": activations,
                               "cache": 0, "limit": 80 * GIB, **more})
    assert value is not None
    return value


def test_the_failed_attempt_beside_the_one_that_fit_reads_like_the_issue() -> None:
    found = memoryparts.compare(event(1, 32, "oom", int(13.8 * GIB)), event(2, 16, "peak", int(6.9 * GIB)))
    assert found is not None and not found.no_room
    assert found.text == ("activations 13.8 GiB at micro-batch 32, 6.9 GiB at 16: about 441.6 MiB a sample; "
                          "weights, gradients and AdamW state 2.0 GiB at both")
    assert found.per_sample_bytes == int((int(13.8 * GIB) - int(6.9 * GIB)) // 16)


def test_no_room_for_one_sample_is_said_with_the_figures_and_what_would_change_them() -> None:
    failed = event(2, 2, "oom", 3 * GIB, limit=3 * GIB)
    found = memoryparts.compare(failed, event(1, 4, "oom", 6 * GIB, limit=3 * GIB), ["--grad-checkpointing"])
    assert found is not None and found.no_room and found.per_sample_bytes == int(1.5 * GIB)
    assert "The fixed part alone leaves no room for one sample: under the 3.0 GiB limit" in found.text
    assert "AdamW state leave 1.0 GiB, less than one sample's activations (about 1.5 GiB)" in found.text
    assert "(--grad-checkpointing, --fallback-args)" in found.text
    plain = memoryparts.compare(failed, None)
    assert plain is not None and "gradient checkpointing, an 8-bit optimizer" in plain.text


def test_an_early_failure_makes_no_per_sample_claim() -> None:
    found = memoryparts.compare(event(1, 16, "oom", GIB), event(2, 8, "peak", 2 * GIB))
    assert found is not None and "no per-sample figure" in found.text and "a sample;" not in found.text
    assert not found.no_room


def test_the_watch_journals_the_oom_at_a_memory_failure_and_the_peak_otherwise() -> None:
    watch = BreakdownWatch()
    said: list[tuple[str, dict[str, Any]]] = []

    def journal(name: str, **data: Any) -> None:
        said.append((name, data))

    record = {"type": "memory", "pid": 7, "rank": 0, "t": 1.0, "device": "cpu", "weights": 10, "gradients": 1,
              "optimizer_state": 2, "frozen_weights": 0, "optimizers": ["SGD"], "activations": 5}
    watch.take({**record, "at": "oom"}, 1)
    watch.take({**record, "at": "peak"}, 1)
    assert [d["at"] for d in watch.ended("host_oom", 1, 4, journal)] == ["oom"]
    assert said[0][0] == EVENT and said[0][1]["micro_batch"] == 4 and said[0][1]["weights"] == 10
    watch.take({**record, "at": "peak"}, 2)
    assert [d["at"] for d in watch.ended(None, 2, 2, journal)] == ["peak"]
    assert watch.ended("crash", 3, 2, journal) == []  # not a memory failure, no peak: nothing to say


def test_a_kernel_kill_is_the_last_reading_that_still_saw_the_trainer() -> None:
    reads = {10: ("python3", 300), 11: ("pt_data_worker", 100), 12: ("python3", 20)}
    watch = BreakdownWatch(read=lambda pid: reads.get(pid))
    group = CgroupMemory("/nonexistent", 1, 500, 450, 480, 0)
    sample = MemorySample(0.0, 5.0, 10, 400, (10, 11, 12), 1000, 500, group, None)
    watch.sampled(sample, 1)
    del reads[10]  # the trainer is gone; its DataLoader worker outlives it a moment
    watch.sampled(MemorySample(0.2, 5.2, 10, 100, (11,), 1000, 500, group, None), 1)
    assert isinstance(watch.last, LastReading) and watch.last.t == 5.0
    (data,) = watch.ended("host_oom", 1, 1, lambda name, **data: None)
    assert data["at"] == "last_reading" and data["limit"] == 480 and data["limit_kind"] == "cgroup"
    assert data["total"] == 450 and data["weights"] is None and data["activations"] is None
    assert [(p["role"], p["name"]) for p in data["processes"]] == [
        ("trainer", "python3"), ("data-loader worker", "pt_data_worker"), ("other", "python3")]
    value = memoryparts.parse({"attempt": 1, **data})
    assert value is not None and memoryparts.parts_text(value) == (
        "no part seen; by process: trainer 300 B, data-loader worker 100 B, other 20 B; limit 480 B (cgroup)")


def test_the_report_gets_each_failures_breakdowns_in_statuss_words_and_its_comparison() -> None:
    value = event(1, 32, "oom", 2 * GIB, snapshot="/r/s.pickle",
                  stacks=[{"where": "t.py:3 in f", "bytes": GIB, "allocations": 2}])
    failures: list[dict[str, Any]] = [{"attempt": 1}, {"attempt": 3}]
    memoryparts.annotate(failures, [value], [{"failed_attempt": 1, "text": "activations ..."}])
    assert "memory" not in failures[1]
    text = memoryparts.lines(failures[0])
    assert text[0] == f"    memory:   {memoryparts.line(value)}"  # the line status shows
    assert text[0].startswith("    memory:   attempt 1 at micro-batch 32, rank 0, at the OOM: weights 512.0 MiB, ")
    assert "    snapshot: /r/s.pickle (open it in https://pytorch.org/memory_viz)" in text
    assert "      1.0 GiB in 2 allocations at t.py:3 in f" in text and text[-1] == "    across:   activations ..."


def test_a_host_ooms_activations_are_a_lower_bound_and_said_so() -> None:
    failed = event(1, 16, "oom", 4 * GIB, device="cpu", cache=None)
    found = memoryparts.compare(failed, event(2, 8, "peak", GIB, device="cpu", cache=None))
    assert found is not None
    assert found.text.startswith("activations at least 4.0 GiB at micro-batch 16, 1.0 GiB at 8: at least 384.0 MiB a")
    value = event(1, 16, "oom", 4 * GIB, device="cpu", cache=None, baseline=300 * MIB)
    assert "activations at least 4.0 GiB (read once the error unwound)" in memoryparts.line(value)
    assert memoryparts.line(value).endswith(", held before the model 300.0 MiB; limit 80.0 GiB")
