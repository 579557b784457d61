"""record/memorylines.py and observe/breakdown.py: the comparison's words, the no-room verdict, what is journaled."""

from __future__ import annotations

from typing import Any

from oomguard.supervisor.observe.allocator import EVENT, BreakdownWatch, LastReading
from oomguard.supervisor.observe.cgroup import CgroupMemory
from oomguard.supervisor.observe.sampler import MemorySample
from oomguard.supervisor.record import memorylines

GIB = 2**30


def event(attempt: int, micro: int, at: str, activations: int, **more: Any) -> dict[str, Any]:
    return {"attempt": attempt, "micro_batch": micro, "at": at, "rank": 0, "device": "cuda:0",
            "weights": GIB // 2, "frozen_weights": 0, "gradients": GIB // 2, "optimizer_state": GIB,
            "optimizers": ["AdamW"], "activations": activations, "cache": 0, "limit": 80 * GIB, **more}


def test_the_failed_attempt_beside_the_one_that_fit_reads_like_the_issue() -> None:
    found = memorylines.compare(event(1, 32, "oom", int(13.8 * GIB)), event(2, 16, "peak", int(6.9 * GIB)))
    assert found is not None and not found.no_room
    assert found.text == ("activations 13.8 GiB at micro-batch 32, 6.9 GiB at 16: about 441.6 MiB a sample; "
                          "weights, gradients and AdamW state 2.0 GiB at both")
    assert found.per_sample == int((int(13.8 * GIB) - int(6.9 * GIB)) // 16)


def test_no_room_for_one_sample_is_said_with_the_figures_and_what_would_change_them() -> None:
    failed = event(2, 2, "oom", 3 * GIB, limit=3 * GIB)
    found = memorylines.compare(failed, event(1, 4, "oom", 6 * GIB, limit=3 * GIB), ["--grad-checkpointing"])
    assert found is not None and found.no_room and found.per_sample == int(1.5 * GIB)
    assert "The fixed part alone leaves no room for one sample: under the 3.0 GiB limit" in found.text
    assert "AdamW state leave 1.0 GiB, less than one sample's activations (about 1.5 GiB)" in found.text
    assert "(--grad-checkpointing, --fallback-args)" in found.text
    plain = memorylines.compare(failed, None)
    assert plain is not None and "gradient checkpointing, an 8-bit optimizer" in plain.text


def test_an_early_failure_makes_no_per_sample_claim() -> None:
    found = memorylines.compare(event(1, 16, "oom", GIB), event(2, 8, "peak", 2 * GIB))
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
    line = memorylines.breakdown_text({"attempt": 1, **data})
    assert line.startswith("last reading before the kill: 450 B of the 480 B cgroup limit: trainer 10 (python3)")


def test_the_report_gets_each_failures_breakdowns_and_its_comparison() -> None:
    rows = [{"kind": EVENT, "attempt": 1, "data": event(1, 32, "oom", 2 * GIB, snapshot="/r/s.pickle",
                                                           stacks=[{"where": "t.py:3 in f", "bytes": GIB,
                                                                    "allocations": 2}])},
            {"kind": memorylines.COMPARISON, "attempt": 2, "data": {"failed_attempt": 1, "text": "activations ..."}}]
    failures: list[dict[str, Any]] = [{"attempt": 1}, {"attempt": 3}]
    memorylines.annotate(failures, rows)
    assert "memory" not in failures[1]
    text = memorylines.lines(failures[0])
    assert text[0].startswith("    memory:   rank 0 at the OOM: weights 512.0 MiB, gradients 512.0 MiB, AdamW state")
    assert "    snapshot: /r/s.pickle (open it in https://pytorch.org/memory_viz)" in text
    assert "      1.0 GiB in 2 allocations at t.py:3 in f" in text and text[-1] == "    across:   activations ..."


def test_a_host_ooms_activations_are_a_lower_bound_and_said_so() -> None:
    failed = event(1, 16, "oom", 4 * GIB, device="cpu", cache=None)
    found = memorylines.compare(failed, event(2, 8, "peak", GIB, device="cpu", cache=None))
    assert found is not None
    assert found.text.startswith("activations at least 4.0 GiB at micro-batch 16, 1.0 GiB at 8: at least 384.0 MiB a")
    assert "activations at least 4.0 GiB (read once the error unwound)" in memorylines.breakdown_text(failed)
