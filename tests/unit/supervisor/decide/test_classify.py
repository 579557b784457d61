"""Exit classification from real-looking output and counters."""

from __future__ import annotations

import os
import signal

import pytest

from oomguard.common.batch import BatchPlan
from oomguard.probe import SITE_DIR
from oomguard.supervisor.decide.classify import (
    Addition,
    ExitFacts,
    FailureKind,
    Fatal,
    Judgement,
    OwnFault,
    Verdict,
    at_oom,
    classify,
    judge,
    own_fault,
    seen,
)
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.distributed.launcher import RootCause
from oomguard.supervisor.lifecycle import EXIT_GAVE_UP, EXIT_UNFIXABLE
from oomguard.supervisor.observe.allocator import AllocatorOom
from oomguard.supervisor.observe.output import OutputScanner
from oomguard.supervisor.run.process import OWN_CODE
from oomguard.supervisor.run.spare import BOOTSTRAP


def scan(*lines: str) -> OutputScanner:
    s = OutputScanner()
    for line in lines:
        s.feed(line)
    return s


# Every out-of-memory text, per library and version: tests/unit/common/test_oomtexts.py.


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


# --- merged from tests/test_fragmentation.py ----------------------------------------------------------------
# Fragmentation is judged from the allocator's figures: the three real H100 OOMs where a retry at
# the same size failed are not fragmentation; a large share of unusable reserved memory is.


GiB = 2**30
# The real texts, from nanoGPT on an 80 GB H100 (alone and via torchrun) and two DDP ranks capped
# with a per-process memory fraction.
NANOGPT = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has a total "
           "capacity of 79.18 GiB of which 56.19 MiB is free. Including non-PyTorch memory, this process has "
           "79.11 GiB memory in use. Of the allocated memory 76.39 GiB is allocated by PyTorch, and 2.06 GiB "
           "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
TORCHRUN = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has a total "
            "capacity of 79.18 GiB of which 374.19 MiB is free. Including non-PyTorch memory, this process "
            "has 78.80 GiB memory in use. Of the allocated memory 75.96 GiB is allocated by PyTorch, and "
            "1.62 GiB is reserved by PyTorch but unallocated.")
DDP_CAPPED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total "
              "capacity of 79.18 GiB of which 31.02 GiB is free. Including non-PyTorch memory, this process "
              "has 23.40 GiB memory in use. Process 8812 has 23.40 GiB memory in use. 23.75 GiB allowed; Of "
              "the allocated memory 22.06 GiB is allocated by PyTorch, and 1.19 GiB is reserved by PyTorch "
              "but unallocated.")
FRAGMENTED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total "
              "capacity of 79.18 GiB of which 200.00 MiB is free. Of the allocated memory 62.00 GiB is "
              "allocated by PyTorch, and 16.00 GiB is reserved by PyTorch but unallocated.")


def _failure(text: str, micro: int = 512, predicted: float | None = None) -> Failure:
    scan = OutputScanner()
    scan.feed(text)
    verdict = judge(scan.tried_bytes, scan.reserved_unallocated, scan.capacity_bytes, predicted)
    return Failure(1, FailureKind.CUDA_OOM, micro, text, verdict.fragmented)


@pytest.mark.parametrize("text", [NANOGPT, TORCHRUN, DDP_CAPPED])
def test_a_few_gib_unallocated_is_not_fragmentation_halve_and_set_expandable(text: str) -> None:
    plan = Plan(BatchPlan(512, 1024, 1))
    d = decide(_failure(text), [], plan, PolicyConfig())
    assert d.action is Action.RESTART
    assert d.plan.batch.micro_batch == 256 and d.plan.batch.grad_accum == 4  # global batch exact
    assert d.plan.expandable_segments  # set in the same restart, no attempt spent on it alone
    assert "expandable_segments:True" in d.reason


def test_scanner_reads_the_allowed_cap_before_the_device_capacity() -> None:
    scan = OutputScanner()
    scan.feed(DDP_CAPPED)
    assert scan.capacity_bytes == int(23.75 * GiB) and scan.reserved_unallocated == int(1.19 * GiB)
    assert scan.allowed_bytes == int(23.75 * GiB)  # a per-process cap NVML cannot see: the limit that applied
    whole = OutputScanner()
    whole.feed(TORCHRUN)
    assert whole.capacity_bytes == int(79.18 * GiB) and whole.allowed_bytes is None
    assert "5%" in judge(scan.tried_bytes, scan.reserved_unallocated, scan.capacity_bytes).why


def test_a_large_share_unallocated_is_fragmentation_same_size_first() -> None:
    plan = Plan(BatchPlan(512, 1024, 1))
    d = decide(_failure(FRAGMENTED), [], plan, PolicyConfig())
    assert d.plan.batch.micro_batch == 512 and d.plan.expandable_segments
    # and if it fails again with the option set, the batch halves
    d2 = decide(_failure(FRAGMENTED), [_failure(FRAGMENTED)], d.plan, PolicyConfig())
    assert d2.plan.batch.micro_batch == 256


def test_the_memory_model_vetoes_a_retry_it_predicts_cannot_fit() -> None:
    assert _failure(FRAGMENTED).fragmented
    assert not _failure(FRAGMENTED, predicted=90 * GiB).fragmented  # measured peaks: 512 needs 90 GiB
    assert _failure(FRAGMENTED, predicted=70 * GiB).fragmented


def test_no_figures_no_fragmentation() -> None:
    assert not judge(None, None, None).fragmented
    assert not judge(GiB, 2 * GiB, None).fragmented  # no capacity in the text: cannot be judged large


def test_at_the_floor_expandable_segments_is_tried_before_giving_up() -> None:
    plan = Plan(BatchPlan(1, 8, 1))
    d = decide(_failure(NANOGPT, micro=1), [], plan, PolicyConfig())
    assert d.action is Action.RESTART and d.plan.expandable_segments and d.plan.batch.micro_batch == 1
    d2 = decide(_failure(NANOGPT, micro=1), [], d.plan, PolicyConfig())
    assert d2.action is Action.GIVE_UP


# --- merged from tests/test_fragmentation_pins.py -----------------------------------------------------------
# Each verdict of the fragmentation judgement with its reason word for word, at its boundaries,
# and which figures it is judged from: the probe's at the OOM, else the OOM message's
# (docs/mutation.md: the survivors these pin).


GIB = 2**30
NO_FIGURES = Judgement(False, "the OOM message has no allocator figures")
TEN_PERCENT = "8.0 GiB reserved but unallocated, 10% of the 80.0 GiB it may use"
FRAGMENTED_JUDGEMENT = Judgement(True, f"fragmentation: {TEN_PERCENT}")


def test_without_the_request_or_the_unallocated_figure_there_is_no_judgement() -> None:
    assert judge(None, 5 * GIB, 80 * GIB) == NO_FIGURES
    assert judge(1 * GIB, None, 80 * GIB) == NO_FIGURES


def test_unallocated_memory_no_larger_than_the_request_cannot_be_what_blocked_it() -> None:
    assert judge(2 * GIB, 2 * GIB, 80 * GIB) == Judgement(
        False, "only 2.0 GiB reserved but unallocated for a 2.0 GiB request")


def test_without_the_capacity_no_share_can_be_judged() -> None:
    assert judge(1 * GIB, 8 * GIB, None) == Judgement(
        False, "the OOM message does not say how much memory the process may use")


def test_a_predicted_peak_at_the_capacity_still_fits_one_above_it_does_not() -> None:
    assert judge(1 * GIB, 8 * GIB, 80 * GIB, predicted_peak=80 * GIB) == FRAGMENTED_JUDGEMENT
    assert judge(1 * GIB, 8 * GIB, 80 * GIB, predicted_peak=81 * GIB) == Judgement(
        False, "the memory model predicts a 81.0 GiB peak at this micro-batch, above the 80.0 GiB available")


def test_ten_percent_unallocated_is_fragmentation_nine_is_not() -> None:
    assert judge(1 * GIB, 8 * GIB, 80 * GIB) == FRAGMENTED_JUDGEMENT
    assert judge(1 * GIB, 7 * GIB, 80 * GIB) == Judgement(
        False, "not fragmentation: 7.0 GiB reserved but unallocated, 9% of the 80.0 GiB it may use (below 10%)")


def test_the_probes_figures_come_first_with_its_own_limit() -> None:
    """The message said 1 GiB unallocated of a 40 GiB cap; the allocator saw 8 GiB of its 80 GiB."""
    probe = AllocatorOom("cuda:0", 1 * GIB, 62 * GIB, 70 * GIB, None, 80 * GIB, None)
    assert at_oom(probe, 2 * GIB, 1 * GIB, 40 * GIB) == Judgement(
        True, f"fragmentation: {TEN_PERCENT} (the allocator's figures at the OOM)")
    assert at_oom(probe, 2 * GIB, 1 * GIB, 40 * GIB, predicted_peak=90 * GIB) == Judgement(
        False, "the memory model predicts a 90.0 GiB peak at this micro-batch, above the 80.0 GiB available "
        "(the allocator's figures at the OOM)")
    no_total = AllocatorOom("cuda:0", 1 * GIB, 62 * GIB, 70 * GIB, None, None, None)
    assert at_oom(no_total, 2 * GIB, 1 * GIB, 40 * GIB) == Judgement(
        True, "fragmentation: 8.0 GiB reserved but unallocated, 20% of the 40.0 GiB it may use (the allocator's "
        "figures at the OOM)")


def test_a_probe_record_missing_a_figure_leaves_the_judgement_to_the_message() -> None:
    no_request = AllocatorOom("cuda:0", None, 62 * GIB, 70 * GIB, None, 80 * GIB, None)
    no_allocated = AllocatorOom("cuda:0", 1 * GIB, None, 70 * GIB, None, 80 * GIB, None)
    for probe in (None, no_request, no_allocated):
        assert at_oom(probe, 1 * GIB, 8 * GIB, 80 * GIB) == FRAGMENTED_JUDGEMENT
        assert at_oom(probe, 1 * GIB, 8 * GIB, 80 * GIB, predicted_peak=90 * GIB) == Judgement(
            False, "the memory model predicts a 90.0 GiB peak at this micro-batch, above the 80.0 GiB available")
        assert at_oom(probe, 1 * GIB, 8 * GIB, 160 * GIB) == Judgement(
            False, "not fragmentation: 8.0 GiB reserved but unallocated, 5% of the 160.0 GiB it may use (below 10%)")


# --- merged from tests/test_unfixable.py --------------------------------------------------------------------
# Errors no restart can fix (decide/unfixable.py): read from the output as it streams, then one rule;
# then real scripts under the real CLI: a missing module is run twice, a script that does not compile once.


PLAN = Plan(BatchPlan(8, 16, 1))
IMPORT = ["Traceback (most recent call last):", '  File "/w/train.py", line 1, in <module>', "    import wandb",
          "ModuleNotFoundError: No module named 'wandb'"]
COMPILE = ['  File "/w/train.py", line 3', "    x = (", "        ^", "SyntaxError: '(' was never closed"]
USAGE = ["usage: train.py [-h] --batch-size BATCH_SIZE",
         "train.py: error: the following arguments are required: --batch-size"]


def failure(attempt: int, fatal: Fatal | None, kind: FailureKind = FailureKind.CRASH) -> Failure:
    return Failure(attempt, kind, 8, evidence="exit 1", fatal=fatal)


def test_the_exception_line_is_kept_and_a_script_that_does_not_compile_says_so_alone() -> None:
    assert seen(scan(*IMPORT), 1, progressed=False) == Fatal("ModuleNotFoundError: No module named 'wandb'")
    assert seen(scan(*COMPILE), 1, progressed=False) == Fatal("SyntaxError: '(' was never closed", alone=True)
    # a syntax error in a module the script imports comes under a traceback: two attempts decide
    imported = seen(scan(*IMPORT[:3], '  File "/w/helper.py", line 2', "IndentationError: unexpected indent"), 1, False)
    assert imported == Fatal("IndentationError: unexpected indent")
    assert seen(scan("[rank0]: FileNotFoundError: [Errno 2] No such file or directory: 'data/train.bin'"), 1,
                False) == Fatal("FileNotFoundError: [Errno 2] No such file or directory: 'data/train.bin'")
    assert seen(scan(*USAGE), 2, progressed=False) == Fatal(USAGE[1])
    assert seen(scan(*USAGE), 1, progressed=False) is None  # argparse exits 2; another status is not its usage error
    assert seen(scan(*IMPORT), 1, progressed=True) is None  # after a step: a restart may get past it
    assert seen(scan("  ImportError: quoted, not raised", "ValueError: bad shard"), 1, False) is None


def test_the_same_error_twice_in_a_row_or_once_where_its_class_says_it_ends_the_run() -> None:
    config = PolicyConfig()
    first = failure(1, Fatal("ModuleNotFoundError: No module named 'wandb'"))
    assert decide(first, [], PLAN, config).action is Action.RESTART
    second = failure(2, Fatal("ModuleNotFoundError: No module named 'wandb'"))
    decision = decide(second, [first], PLAN, config)
    assert decision.action is Action.GIVE_UP and decision.unfixable
    assert decision.reason.startswith("ModuleNotFoundError: No module named 'wandb', before the first step in "
                                      "attempts 1 and 2: no restart can fix it")
    alone = decide(failure(1, Fatal("SyntaxError: invalid syntax", alone=True)), [], PLAN, config)
    assert alone.action is Action.GIVE_UP and alone.unfixable and "does not compile" in alone.reason
    # another error, a gap (a planned restart between them), or a memory failure: retried as before
    other = failure(2, Fatal("ImportError: cannot import name 'x'"))
    assert decide(other, [first], PLAN, config).action is Action.RESTART
    assert decide(failure(3, first.fatal), [first], PLAN, config).action is Action.RESTART
    oom = failure(2, first.fatal, FailureKind.CUDA_OOM)
    assert not decide(oom, [first], PLAN, config).unfixable


def test_its_exit_status_is_its_own() -> None:
    assert EXIT_UNFIXABLE not in (0, EXIT_GAVE_UP, 2, 75) and EXIT_UNFIXABLE < 128


# --- merged from tests/test_ownfault.py ---------------------------------------------------------------------
# The rule that tells oomguard's own failures from the script's (decide/ownfault.py), fed tracebacks
# as the worker prints them, and the policy that follows from it (decide/policy.py).


PKG = OWN_CODE.roots[0]
TORCH = "/venv/lib/python3.12/site-packages/torch"
BOTH = frozenset(Addition)


def scanned(text: str, after: int = 0) -> OutputScanner:
    scan = OutputScanner()
    for line in text.splitlines():
        scan.feed(line)
    for n in range(after):
        scan.feed(f"a line of output {n}")
    return scan


def fault(text: str, kind: FailureKind = FailureKind.CRASH, in_use: frozenset[Addition] = BOTH,
          after: int = 0) -> OwnFault | None:
    return own_fault(kind, scanned(text, after), in_use, OWN_CODE)


PROBE_HOOK = f'''Traceback (most recent call last):
  File "/home/u/proj/train.py", line 20, in <module>
    loss = model(x).sum()
  File "{TORCH}/nn/modules/module.py", line 1776, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
  File "{TORCH}/nn/modules/module.py", line 1850, in _call_impl
    hook_result = hook(self, args, result)
  File "{PKG}/probe/forward.py", line 85, in post
    self._learned.setdefault(id(module), self._leaves)
AttributeError: 'NoneType' object has no attribute 'setdefault'
'''

# The torch.compile failure: dynamo raised while tracing the probe's hook.
DYNAMO = f'''Traceback (most recent call last):
  File "/home/u/gpt/train.py", line 300, in <module>
    logits, loss = model(X, Y)
  File "{TORCH}/_dynamo/eval_frame.py", line 655, in _fn
    return fn(*args, **kwargs)
  File "{TORCH}/_dynamo/symbolic_convert.py", line 1100, in run
    while self.step():
  File "{TORCH}/_dynamo/side_effects.py", line 300, in track_object_existing
    assert not self.is_attribute_mutation(item)
AssertionError: UnspecializedNNModuleVariable(LM) is already tracked for mutation. This could be because it was
  passed to the hook twice

from user code:
   File "{PKG}/probe/forward.py", line 77, in pre
    if self._depth == 0 or module is self._root:

Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace (please do this especially if you're reporting a bug to PyTorch).
'''

# The program's own exception, raised by its object's __getstate__ inside the save our wrapper passed on.
THROUGH_SAVE = f'''Traceback (most recent call last):
  File "/home/u/proj/train.py", line 30, in <module>
    torch.save({{"state": Bad()}}, "ckpt.pt")
  File "{PKG}/probe/steps.py", line 45, in save
    result = original(obj, f, *args, **kwargs)  # its exception is the program's
  File "{TORCH}/serialization.py", line 966, in save
    _save(obj, opened_zipfile, pickle_module, pickle_protocol, _disable_byteorder_record)
  File "{TORCH}/serialization.py", line 1209, in _save
    pickler.dump(obj)
  File "/home/u/proj/train.py", line 8, in __getstate__
    raise RuntimeError("the user's own error")
RuntimeError: the user's own error
'''

# The user's sys.excepthook, which ours chains to, raising: Python prints that, then the original.
THROUGH_EXCEPTHOOK = f'''Error in sys.excepthook:
Traceback (most recent call last):
  File "{PKG}/probe/oom.py", line 85, in excepthook
    previous(kind, exc, tb)
  File "/home/u/proj/train.py", line 4, in hook
    raise ValueError("the user's hook fails")
ValueError: the user's hook fails

Original exception was:
Traceback (most recent call last):
  File "/home/u/proj/train.py", line 30, in <module>
    step(batch)
  File "/home/u/proj/train.py", line 22, in step
    raise KeyError("label")
KeyError: 'label'
'''

HANDOVER = f'''Traceback (most recent call last):
  File "{BOOTSTRAP}", line 189, in <module>
    main()
  File "{BOOTSTRAP}", line 186, in main
    _become(json.loads(text))
  File "{BOOTSTRAP}", line 144, in _become
    _run_as_main(str(spec["script"]))
  File "{BOOTSTRAP}", line 156, in _run_as_main
    with io.open_code(path) as fh:
IsADirectoryError: [Errno 21] Is a directory: '/home/u/proj/app'
'''


def test_the_probes_own_frame_innermost_is_ours() -> None:
    own = fault(PROBE_HOOK)
    assert own == OwnFault(Addition.PROBE, "oomguard/probe/forward.py, line 85, in post")
    assert own.reason == ("oomguard's probe failed (oomguard/probe/forward.py, line 85, in post); the next attempt "
                          "runs without the probe")


def test_dynamo_failing_in_the_probes_hook_is_ours() -> None:
    own = fault(DYNAMO)
    assert own is not None and own.addition is Addition.PROBE
    assert own.frame == "oomguard/probe/forward.py, line 77, in pre"


def test_the_programs_exception_through_our_save_wrapper_or_excepthook_is_the_scripts() -> None:
    assert fault(THROUGH_SAVE) is None
    assert fault(THROUGH_EXCEPTHOOK) is None
    # torch's own error inside the save our wrapper passed on (a full disk, a pickling error): the script's
    torch_error = THROUGH_SAVE.split('  File "/home/u/proj/train.py", line 8')[0] + "OSError: [Errno 28]\n"
    assert fault(torch_error) is None


def test_a_spares_handover_is_ours_only_in_an_attempt_handed_to_a_spare() -> None:
    own = fault(HANDOVER)
    assert own is not None and own.addition is Addition.SPARE and own.frame.startswith(
        "oomguard/supervisor/run/sparestart.py, line 156, in _run_as_main")
    assert "starts cold, without spares" in own.reason
    assert fault(HANDOVER, in_use=frozenset({Addition.PROBE})) is None
    assert fault(PROBE_HOOK, in_use=frozenset({Addition.SPARE})) is None  # --no-probe: not the probe's
    # The script's exception after the handover: its frames innermost, whatever ran before it.
    script = HANDOVER.replace("    with io.open_code(path) as fh:\nIsADirectoryError: [Errno 21] Is a directory: "
                              "'/home/u/proj/app'", '''    exec(code, main.__dict__)
  File "/home/u/proj/train.py", line 3, in <module>
    import wandb
ModuleNotFoundError: No module named 'wandb\'''')
    assert fault(script) is None


def test_a_spare_that_had_exited_before_its_handover_is_ours_whatever_ended_the_attempt() -> None:
    lost = "it had exited before the handover, killed by SIGKILL"
    for kind in (FailureKind.HOST_OOM, FailureKind.KILLED, FailureKind.CRASH):
        own = own_fault(kind, scanned(""), BOTH, OWN_CODE, lost)
        assert own == OwnFault(Addition.SPARE, lost)  # the script never ran: not its batch's
    assert own_fault(FailureKind.HOST_OOM, scanned(""), frozenset({Addition.PROBE}), OWN_CODE, lost) is None


def test_the_worker_library_is_the_probes_only_when_the_probe_called_it() -> None:
    library = f'''Traceback (most recent call last):
  File "/home/u/proj/train.py", line 12, in <module>
    {{}}
  File "{PKG}/common/protocol.py", line 90, in emit
    os.write(fd, data)
OSError: [Errno 9] Bad file descriptor
'''
    by_probe = library.format(f'''opt.step()
  File "{PKG}/probe/steps.py", line 120, in report
    channel.emit(protocol.STEP, step=self.step)
  File "{PKG}/probe/channel.py", line 37, in emit
    protocol.emit(record_type, **fields, **identity())''')
    own = fault(by_probe)
    assert own is not None and own.addition is Addition.PROBE and own.frame.startswith("oomguard/common/protocol.py")
    assert fault(library.format("oomguard.common.protocol.emit('progress', step=3)")) is None  # the script's call


def test_only_a_crash_whose_traceback_ended_the_output_is_ours() -> None:
    assert fault(PROBE_HOOK, FailureKind.HOST_OOM) is None  # memory ran out where our code happened to allocate
    assert fault(PROBE_HOOK, after=45) is not None
    assert fault(PROBE_HOOK, after=60) is None  # printed and survived: the program logged it and went on
    # A later traceback of the program's own replaces ours.
    assert fault(PROBE_HOOK + THROUGH_SAVE) is None
    assert fault("exit code 1, no traceback\n") is None


def test_our_code_is_where_the_worker_is_handed_it() -> None:
    assert OWN_CODE.addition_of(os.path.join(SITE_DIR, "sitecustomize.py")) is Addition.PROBE
    assert OWN_CODE.addition_of(BOOTSTRAP) is Addition.SPARE
    assert OWN_CODE.addition_of(os.path.join(PKG, "supervisor", "run", "loop.py")) is None
    assert OWN_CODE.addition_of("/elsewhere/oomguard/probe/forward.py") is None  # another install's


# ----- the policy


PLAN_OWNFAULT = Plan(BatchPlan(8, 16))
CONFIG = PolicyConfig(max_restarts=2)
OURS = OwnFault(Addition.PROBE, "oomguard/probe/forward.py, line 85, in post")


def crash(attempt: int, own: OwnFault | None = None) -> Failure:
    return Failure(attempt, FailureKind.CRASH, 8, "exit code 1", own=own)


def test_our_failure_restarts_at_once_at_the_same_batch_without_the_addition() -> None:
    decision = decide(crash(1, OURS), [], PLAN_OWNFAULT, CONFIG)
    assert decision.action is Action.RESTART and decision.plan == PLAN_OWNFAULT and decision.delay == 0
    assert decision.turn_off is Addition.PROBE and decision.reason == OURS.reason


@pytest.mark.parametrize("ours", [1, 2])
def test_our_failures_are_not_counted_against_the_script(ours: int) -> None:
    history = [crash(n, OURS if n <= ours else None) for n in range(1, 3)]
    # Counted: --max-restarts 2 would be used up and the same crash three times would be a crash loop.
    decision = decide(crash(3), history, PLAN_OWNFAULT, CONFIG)
    assert decision.action is Action.RESTART and decision.turn_off is None
    assert decision.delay == CONFIG.backoff * 2 ** (2 - ours)  # the backoff counts the script's crashes only
    counted = decide(crash(3), [crash(1), crash(2)], PLAN_OWNFAULT, CONFIG)
    assert counted.action is Action.GIVE_UP  # as before for the script's own


def test_a_second_failure_of_the_same_addition_counts_as_the_scripts() -> None:
    """It is off after its first: a second would be a bug of ours, and must not restart the run for ever."""
    decision = decide(crash(2, OURS), [crash(1, OURS)], PLAN_OWNFAULT, PolicyConfig(max_restarts=0))
    assert decision.action is Action.GIVE_UP and decision.turn_off is None
    spare = OwnFault(Addition.SPARE, "oomguard/supervisor/run/sparestart.py, line 156, in _run_as_main")
    assert decide(crash(2, spare), [crash(1, OURS)], PLAN_OWNFAULT, CONFIG).turn_off is Addition.SPARE
