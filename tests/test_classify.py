"""Exit classification from real-looking output and counters."""

from __future__ import annotations

import signal

from oomguard.supervisor.decide.classify import ExitFacts, FailureKind, classify
from oomguard.supervisor.observe.output import OutputScanner


def scan(*lines: str) -> OutputScanner:
    s = OutputScanner()
    for line in lines:
        s.feed(line)
    return s


# Every out-of-memory text, per library and version: tests/test_oom_corpus.py.


def test_cpu_allocator_is_host_oom() -> None:
    line = "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
    assert classify(ExitFacts(1), scan(line)).kind is FailureKind.HOST_OOM


def test_sigkill_with_oom_counter_is_host_oom() -> None:
    v = classify(ExitFacts(-9, 0, 1, "cgroup /x"), scan())
    assert v.kind is FailureKind.HOST_OOM and "oom_kill 0->1" in v.evidence and v.signal == 9


def test_sigkill_at_our_limit_is_memory_limit() -> None:
    v = classify(ExitFacts(-9, 2, 3, "cgroup /x", limit_hit=True), scan())
    assert v.kind is FailureKind.MEMORY_LIMIT


def test_sigkill_without_counter_is_killed() -> None:
    v = classify(ExitFacts(-9, 5, 5, "/proc/vmstat"), scan())
    assert v.kind is FailureKind.KILLED and "SIGKILL" in v.evidence


def test_shell_style_137_counts_as_signal() -> None:
    assert classify(ExitFacts(137, 0, 0), scan()).signal == signal.SIGKILL


def test_hang_and_budget_win() -> None:
    assert classify(ExitFacts(-15, hung="no output"), scan()).kind is FailureKind.HANG
    assert classify(ExitFacts(-15, stopped_for_memory="rss"), scan()).kind is FailureKind.MEMORY_LIMIT


def test_crash_carries_last_line() -> None:
    v = classify(ExitFacts(3), scan("Traceback", "ValueError: bad shard", ""))
    assert v.kind is FailureKind.CRASH and v.evidence == "exit code 3: ValueError: bad shard"


def test_success() -> None:
    assert classify(ExitFacts(0), scan("CUDA out of memory")).kind is None


def test_worker_record_is_used() -> None:
    v = classify(ExitFacts(1, worker_failure={"kind": "cuda_oom", "message": "OOM in backward"}), scan())
    assert v.kind is FailureKind.CUDA_OOM and v.evidence == "OOM in backward"


def test_fragmentation_detection() -> None:
    s = scan("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB. Of the allocated "
             "memory 60.00 GiB is allocated by PyTorch, and 9.50 GiB is reserved by PyTorch but unallocated.")
    assert s.fragmented
    s = scan("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. and 512.00 MiB "
             "is reserved by PyTorch but unallocated.")
    assert not s.fragmented


def test_load_error() -> None:
    assert scan("RuntimeError: PytorchStreamReader failed reading zip archive").load_error
