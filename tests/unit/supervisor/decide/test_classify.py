"""Exit classification from real-looking output and counters."""

from __future__ import annotations

import signal

from oomguard.supervisor.decide.classify import ExitFacts, FailureKind, Verdict, classify
from oomguard.supervisor.distributed.errorfiles import RootCause
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


# --- merged from tests/test_classify_pins.py ----------------------------------------------------------------
# The exit classifier pinned where mutation testing (bench/mutation.py) found it loose: the edges of
# a shell's 128+N status, the root-cause rank's exit and evidence, the worker's own record, and the
# evidence text of each verdict.




def rank(exitcode: int | None = 3, sig: int | None = None, oom_kind: str | None = None,
         message: str = "ValueError: bad shape") -> RootCause:
    return RootCause(rank=1, local_rank=1, exitcode=exitcode, signal=sig, host="node-a", message=message,
                     oom_kind=oom_kind, source="error file")


def test_success_is_exit_code_zero_and_no_kind() -> None:
    assert classify(ExitFacts(0), scan("done")) == Verdict(None, "exit code 0", None, 0)


def test_a_shells_128_plus_n_status_is_a_signal_only_from_129_to_192() -> None:
    hup = classify(ExitFacts(129), scan())
    assert (hup.kind, hup.signal, hup.exit_code) == (FailureKind.KILLED, signal.SIGHUP, 129)
    top = classify(ExitFacts(192), scan())
    assert (top.kind, top.signal) == (FailureKind.KILLED, 64)
    for plain in (128, 193):
        v = classify(ExitFacts(plain), scan())
        assert (v.kind, v.signal, v.evidence) == (FailureKind.CRASH, None, f"exit code {plain}")


def test_a_signal_with_no_name_is_named_by_number() -> None:
    v = classify(ExitFacts(-100), scan())
    assert v.kind is FailureKind.KILLED
    assert v.evidence == "terminated by signal 100; no OOM-kill counter moved"


def test_a_crash_names_the_last_line_said_in_the_last_twenty() -> None:
    assert classify(ExitFacts(1), scan()).evidence == "exit code 1"
    assert classify(ExitFacts(1), scan("", "  ")).evidence == "exit code 1"
    assert classify(ExitFacts(1), scan("boom", *[""] * 19)).evidence == "exit code 1: boom"
    assert classify(ExitFacts(1), scan("boom", *[""] * 20)).evidence == "exit code 1"


def test_a_full_disk_is_its_own_kind_with_the_line_that_said_it() -> None:
    line = "OSError: [Errno 28] No space left on device: 'ckpt/step-40.pt'"
    v = classify(ExitFacts(1), scan("step 39", line, "exiting"))
    assert (v.kind, v.evidence) == (FailureKind.DISK_FULL, line)


def test_a_dataloader_worker_killed_under_the_limit_is_a_memory_limit_naming_the_counter() -> None:
    line = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed."
    facts = ExitFacts(1, oom_kills_before=2, oom_kills_after=3, oom_counter="memory.events", limit_hit=True)
    v = classify(facts, scan(line))
    assert v.kind is FailureKind.MEMORY_LIMIT
    assert v.evidence == f"{line} (killed by the kernel OOM killer: memory.events oom_kill 2->3)"


def test_the_worker_librarys_record_without_a_message_gives_empty_evidence() -> None:
    v = classify(ExitFacts(1, worker_failure={"kind": "cuda_oom"}), scan())
    assert (v.kind, v.evidence) == (FailureKind.CUDA_OOM, "")


# --- under torchrun: the root-cause rank ---------------------------------------------------------


def test_the_root_cause_ranks_exit_decides_and_its_evidence_names_it() -> None:
    v = classify(ExitFacts(1), scan(), rank())
    assert v == Verdict(FailureKind.CRASH, "rank 1 (local rank 1) on node-a: exit code 3: ValueError: bad shape",
                        None, 3)
    on_gpu = classify(ExitFacts(1), scan(), rank(), gpus=True)
    assert on_gpu.evidence.startswith("rank 1 (local rank 1, GPU 1) on node-a: ")


def test_a_rank_without_an_exit_code_is_named_by_its_message_and_a_signal_is_no_exit_code() -> None:
    v = classify(ExitFacts(1), scan(), rank(exitcode=None))
    assert (v.kind, v.evidence, v.exit_code) == (FailureKind.CRASH, "rank 1 (local rank 1) on node-a: "
                                                 "ValueError: bad shape", None)
    killed = classify(ExitFacts(1), scan(), rank(exitcode=-9, sig=signal.SIGKILL))
    assert (killed.kind, killed.exit_code, killed.signal) == (FailureKind.KILLED, None, signal.SIGKILL)
    assert classify(ExitFacts(1), scan(), rank(exitcode=0)).exit_code == 0


def test_a_ranks_own_allocation_failure_beats_the_agents_text() -> None:
    cause = rank(oom_kind="cuda_oom", message="torch.OutOfMemoryError: CUDA out of memory.")
    v = classify(ExitFacts(1), scan("some agent line"), cause)
    assert (v.kind, v.evidence) == (FailureKind.CUDA_OOM,
                                    "rank 1 (local rank 1) on node-a: torch.OutOfMemoryError: CUDA out of memory.")
    plain = classify(ExitFacts(1), scan(), rank(oom_kind=None))
    assert plain.kind is FailureKind.CRASH


def test_oomguards_own_stops_name_no_rank() -> None:
    hung = classify(ExitFacts(-9, hung="no output for 1800 s"), scan(), rank())
    assert (hung.kind, hung.evidence, hung.signal) == (FailureKind.HANG, "no output for 1800 s", signal.SIGKILL)
    stopped = classify(ExitFacts(-15, stopped_for_memory="RSS 30 GiB over --memory-limit"), scan(), rank())
    assert (stopped.kind, stopped.evidence) == (FailureKind.MEMORY_LIMIT, "RSS 30 GiB over --memory-limit")
