"""What ended an attempt: a ``FailureKind`` and the evidence that decided it.

``classify`` turns the exit status, what ``observe.output.OutputScanner`` kept, the OOM-kill counters
and, under torchrun, the root-cause rank into a kind; pure, so the tests feed it text and numbers.
Also here: whether a CUDA OOM is fragmentation, the errors no restart can fix, and whether an
attempt died of oomguard's own code (the probe, a spare's handover).
"""

from __future__ import annotations

import enum
import os
import signal
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomguard.supervisor.observe.allocator import AllocatorOom
from oomguard.supervisor.observe.output import OutputScanner, Site
from oomguard.supervisor.units import format_size

if TYPE_CHECKING:  # only annotations: launcher -> torchrun -> lifecycle -> classify would be a cycle
    from oomguard.supervisor.distributed.launcher import RootCause


class FailureKind(enum.Enum):
    CUDA_OOM = "cuda_oom"  # the accelerator's memory, whichever: CUDA, ROCm/HIP, MPS, XPU (docs/oom-messages.md)
    HOST_OOM = "host_oom"
    MEMORY_LIMIT = "memory_limit"
    HANG = "hang"
    KILLED = "killed"
    CRASH = "crash"
    DISK_FULL = "disk_full"  # the worker died of ENOSPC (a checkpoint or log it could not write)

    @property
    def is_memory(self) -> bool:
        return self in (FailureKind.CUDA_OOM, FailureKind.HOST_OOM, FailureKind.MEMORY_LIMIT)


@dataclass(frozen=True)
class ExitFacts:
    """What the supervisor knows when an attempt ends."""

    returncode: int
    oom_kills_before: int | None = None  # the worker cgroup's (or /proc/vmstat's) oom_kill counter
    oom_kills_after: int | None = None
    oom_counter: str = ""  # where the counter came from, for the evidence
    limit_hit: bool = False  # the worker's own cgroup reached oomguard's --memory-limit
    stopped_for_memory: str | None = None  # oomguard stopped it: the reading that broke the budget
    hung: str | None = None  # oomguard killed it as hung: why
    worker_failure: dict[str, object] | None = None  # a structured failure record from the worker


@dataclass(frozen=True)
class Verdict:
    kind: FailureKind | None  # None: the worker succeeded
    evidence: str
    signal: int | None
    exit_code: int | None


_OOM_KINDS = {"cuda_oom": FailureKind.CUDA_OOM, "host_oom": FailureKind.HOST_OOM}


def classify(facts: ExitFacts, scan: OutputScanner, cause: RootCause | None = None, gpus: bool = False) -> Verdict:
    """Decide the kind of an attempt's end; the first rule that matches wins, most specific first.
    Under torchrun (whose agent exits 1 whatever killed a rank) the rules read the root-cause rank's exit
    (``dist.launcher.root_cause``)."""
    if facts.returncode == 0:
        return Verdict(None, "exit code 0", None, 0)
    rc = facts.returncode  # (exit code, signal): Popen gives -N for death by signal N; a shell reports 128+N
    code, sig = (None, -rc) if rc < 0 else (rc, rc - 128) if 128 < rc <= 128 + 64 else (rc, None)
    where = ""
    if cause is not None and not (facts.hung or facts.stopped_for_memory):  # oomguard's own stops name no rank
        code = cause.exitcode if cause.exitcode is not None and cause.exitcode >= 0 else None
        sig, where = cause.signal, f"{cause.where(gpus)}: "
    kind, evidence = _rules(facts, scan, cause, code, sig)
    return Verdict(kind, where + evidence, sig, code)


def _rules(facts: ExitFacts, scan: OutputScanner, cause: RootCause | None, code: int | None,
           sig: int | None) -> tuple[FailureKind, str]:
    """The kind of a failed attempt's end and its evidence, by the first rule that matches."""
    if facts.hung:
        return FailureKind.HANG, facts.hung
    if facts.stopped_for_memory:
        return FailureKind.MEMORY_LIMIT, facts.stopped_for_memory
    if (killed := _oom_killed(facts, scan, cause, sig)) is not None:
        return killed
    # A structured report (the rank's error file, the worker library's record) before parsed text.
    if (reported := _reported(cause, facts.worker_failure)) is not None:
        return reported
    if scan.device_oom:
        return FailureKind.CUDA_OOM, scan.device_oom.strip()
    if scan.host_oom:
        return FailureKind.HOST_OOM, scan.host_oom.strip()
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        return FailureKind.KILLED, f"terminated by {name}; no OOM-kill counter moved"
    if scan.disk_full:  # it exited on its own, having said it could not write
        return FailureKind.DISK_FULL, scan.disk_full.strip()
    if cause is not None:
        return FailureKind.CRASH, (f"exit code {cause.exitcode}: {cause.message}" if cause.exitcode is not None
                                   else cause.message)
    # The exception that ended the traceback, not the hints a library prints after it; else the last line.
    last = scan.exception or next((line.strip() for line in reversed(scan.tail[-20:]) if line.strip()), "")
    return FailureKind.CRASH, f"exit code {code}" + (f": {last}" if last else "")


def _oom_killed(facts: ExitFacts, scan: OutputScanner, cause: RootCause | None,
                sig: int | None) -> tuple[FailureKind, str] | None:
    """The kernel's OOM killer, where its counter rose: it SIGKILLed the process, or (outside
    torchrun) a DataLoader worker, whose main process lives on to report it."""
    before, after = facts.oom_kills_before, facts.oom_kills_after
    if before is None or after is None or after <= before:
        return None
    counter = f"{facts.oom_counter} oom_kill {before}->{after}"
    kind = FailureKind.MEMORY_LIMIT if facts.limit_hit else FailureKind.HOST_OOM
    if sig == signal.SIGKILL:
        return kind, (f"{counter} at oomguard's --memory-limit" if facts.limit_hit
                      else f"killed by the kernel OOM killer ({counter})")
    if cause is None and scan.dataloader:
        return kind, f"{scan.dataloader.strip()} (killed by the kernel OOM killer: {counter})"
    return None


def _reported(cause: RootCause | None, record: dict[str, object] | None) -> tuple[FailureKind, str] | None:
    """An allocation failure the failing process reported itself: its rank's error, else its record."""
    if cause is not None and cause.oom_kind in _OOM_KINDS:
        return _OOM_KINDS[cause.oom_kind], cause.message
    if record and (kind := _OOM_KINDS.get(str(record.get("kind", "")))):
        return kind, str(record.get("message", ""))
    return None


# Is a CUDA OOM fragmentation? Judged from the allocator's own figures in the OOM message.
#
# PyTorch's message says how much was requested, how much the process may use ("total capacity of
# X" or, under a per-process memory fraction, "X allowed") and how much is "reserved by PyTorch but
# unallocated": cached blocks the request did not fit into. ``expandable_segments:True`` lets the
# allocator reuse that memory, so retrying at the same micro-batch can only help when it is a large
# share of what the process may use. On an 80 GB H100 three real OOMs showed 1.2-2.1 GiB (2-5%)
# unallocated for 0.75-1 GiB requests: a retry at the same size failed each time, because the step
# needed far more than those few GiB. Pure: the loop hands it the scanner's numbers, or, where the
# in-process probe caught the OOM, the allocator's own (``at_oom``): reserved minus allocated at that
# moment, against the request and the limit the allocator may reach; those come first.


# Reserved-but-unallocated memory at or above this share of the memory the process may use is what
# blocked the allocation: 16 GiB of 79 GiB is (a defragmented allocator gets that much back);
# 2 GiB of 79 GiB is not (halving the micro-batch frees tens of GiB, which the step needs).
SHARE = 0.10


@dataclass(frozen=True)
class Judgement:
    fragmented: bool
    why: str


def judge(tried: int | None, reserved_unallocated: int | None, capacity: int | None,
          predicted_peak: float | None = None) -> Judgement:
    """Fragmentation or not, and why (``predicted_peak``: the memory model's peak at the failed size)."""
    if tried is None or reserved_unallocated is None:
        return Judgement(False, "the OOM message has no allocator figures")
    if reserved_unallocated <= tried:
        return Judgement(False, f"only {format_size(reserved_unallocated)} reserved but unallocated for a "
                         f"{format_size(tried)} request")
    if capacity is None:
        return Judgement(False, "the OOM message does not say how much memory the process may use")
    if predicted_peak is not None and predicted_peak > capacity:
        # The measured peak per sample says this micro-batch needs more than exists: no allocator
        # setting can make it fit.
        return Judgement(False, f"the memory model predicts a {format_size(predicted_peak)} peak at this "
                         f"micro-batch, above the {format_size(capacity)} available")
    share = reserved_unallocated / capacity
    figures = (f"{format_size(reserved_unallocated)} reserved but unallocated, {share:.0%} of the "
               f"{format_size(capacity)} it may use")
    if share >= SHARE:
        return Judgement(True, f"fragmentation: {figures}")
    return Judgement(False, f"not fragmentation: {figures} (below {SHARE:.0%})")


def at_oom(allocator: AllocatorOom | None, tried: int | None, reserved_unallocated: int | None,
           capacity: int | None, predicted_peak: float | None = None) -> Judgement:
    """Fragmentation judged from the probe's figures at the OOM where it has them, else from the message's."""
    if allocator is None or allocator.requested is None or allocator.reserved_unallocated is None:
        return judge(tried, reserved_unallocated, capacity, predicted_peak)
    found = judge(allocator.requested, allocator.reserved_unallocated, allocator.limit or capacity, predicted_peak)
    return Judgement(found.fragmented, f"{found.why} (the allocator's figures at the OOM)")


# Errors no restart can fix: the rule that stops a run at once instead of retrying them.
#
# A ``ModuleNotFoundError`` at import was run three times before the crash loop gave up, each time
# paying the script's load time, and under systemd the whole give-up was then repeated. An error of
# the script or its environment, raised before the first step, is the same at every restart:
#
# - the same exception line (``ImportError``/``ModuleNotFoundError``, ``SyntaxError`` and its
#   kin, ``FileNotFoundError`` of a file the script opens, argparse's ``prog: error: ...`` with exit
#   status 2) in two attempts in a row, neither of which made progress, ends the run;
# - once is enough where the class alone says it: a ``SyntaxError`` with no traceback before it is
#   python failing to compile the script it was told to run.
#
# The run then ends with ``lifecycle.EXIT_UNFIXABLE`` (3), which a service manager must not restart. Pure: the
# facts come from ``observe.output.OutputScanner`` through the loop.


_COMPILE = ("SyntaxError", "IndentationError", "TabError")
USAGE_EXIT = 2  # argparse's exit status for a usage error


@dataclass(frozen=True)
class Fatal:
    """An error that ended an attempt before its first step and that a restart would meet again."""

    line: str  # the exception line (``ModuleNotFoundError: No module named 'wandb'``)
    alone: bool = False  # its class alone says no restart can fix it (the script does not compile)


def seen(scan: OutputScanner, exit_code: int | None, progressed: bool) -> Fatal | None:
    """The fatal error of an attempt that ended without progress; None when there is none."""
    if progressed:
        return None
    if scan.usage_error is not None and exit_code == USAGE_EXIT:
        return Fatal(scan.usage_error)
    if scan.fatal is None:
        return None
    return Fatal(scan.fatal, scan.fatal_untraced and scan.fatal.startswith(_COMPILE))


def give_up(fatal: Fatal | None, previous: Fatal | None, attempt: int) -> str | None:
    """Why the run ends now, or None when a restart may still help."""
    if fatal is None:
        return None
    if fatal.alone:
        return (f"{fatal.line}: the script does not compile, so no restart can fix it; fix the script and run "
                "oomguard again")
    if previous is not None and previous.line == fatal.line:
        return (f"{fatal.line}, before the first step in attempts {attempt - 1} and {attempt}: no restart can fix "
                "it; fix the script or its environment and run oomguard again")
    return None


# Whether an attempt died of oomguard's own code: the probe in the worker, or a spare's handover.
#
# oomguard adds code to the worker's process: the probe (``oomguard/probe/``, loaded from
# ``probe/site/sitecustomize.py`` under the private name ``_oomguard_probe``) and, when an attempt was
# handed to a spare interpreter, the spare's bootstrap (``supervisor/run/sparestart.py``), which runs
# in the worker's process before the script. When one of them raises into the program, the failure is
# ours, not the script's: the next attempt runs without that addition and nothing is counted against
# the script or its batch (``decide.policy``).
#
# The evidence is the traceback the worker died with, measured, never guessed: its innermost frame
# (the code that raised) must be a file of that addition. A traceback that only passes through ours
# on its way to the program's own exception (our ``torch.save`` wrapper calling the real save, our
# chained ``sys.excepthook``) has the program's or torch's frame innermost and stays the script's.
# Frames of ``oomguard/common/`` and ``oomguard/worker/`` are the probe's only when the probe called
# them (the probe writes its records through ``common/protocol.py``); a script that uses the worker
# library itself owns its calls. Only a crash counts: a memory failure is the batch's wherever the
# allocation happened to be.
# One more is measured outside the traceback: a spare that had exited when the attempt was handed to
# it (``run/spare.py``; the kernel's OOM killer takes a spare first), where the script never ran.
#
# A probe record of state ``failed`` is no such evidence: the probe writes one where it caught its own
# failure and the program went on without that part, so a death after it is not shown to be ours.
# Pure: the scanner's frames and the paths of our code come from the loop.


# After the traceback a process dies with come only its last words: the exception's message (dynamo's
# runs to a few lines after its ``from user code:`` frames), atexit handlers, a launcher's line.
# A traceback further back was printed and survived (the program caught and logged it).
RECENT_LINES = 50
PROBE_DIR = "probe/"  # oomguard/probe/, its site/sitecustomize.py among them
SPARE_FILE = "supervisor/run/sparestart.py"  # what a spare runs in the worker's process before the script
# Shared code whose caller decides: the protocol the probe writes through (common/), and the worker
# library, which a script may use itself.
LIBRARY_DIRS = ("common/", "worker/")


class Addition(enum.Enum):
    """What oomguard adds to a run that can be left out of the next attempt."""

    PROBE = "probe"
    SPARE = "spare"


@dataclass(frozen=True)
class OwnCode:
    """Where the worker's tracebacks show oomguard's code: the package's directory (``roots``: as the
    worker was given it, and with its links resolved)."""

    roots: tuple[str, ...]

    def relative(self, file: str) -> str | None:
        """The file's path inside the package (``probe/forward.py``), or None when it is not ours."""
        for root in self.roots:
            if file.startswith(base := root.rstrip(os.sep) + os.sep):
                return file[len(base):].replace(os.sep, "/")
        return None

    def addition_of(self, file: str) -> Addition | None:
        relative = self.relative(file) or ""
        if relative.startswith(PROBE_DIR):
            return Addition.PROBE
        return Addition.SPARE if relative == SPARE_FILE else None

    def shown(self, site: Site) -> str:
        """``oomguard/probe/forward.py, line 85, in post``."""
        relative = self.relative(site.file) or site.file
        return f"oomguard/{relative}, line {site.line}, in {site.function}"


@dataclass(frozen=True)
class OwnFault:
    """An attempt that died in oomguard's own code, and which addition the next one runs without."""

    addition: Addition
    frame: str  # the innermost frame, as ``OwnCode.shown`` writes it

    @property
    def reason(self) -> str:
        """The attempt's decision: what failed and what follows."""
        if self.addition is Addition.PROBE:
            return f"oomguard's probe failed ({self.frame}); the next attempt runs without the probe"
        return (f"oomguard's spare interpreter failed at its handover ({self.frame}); the next attempt starts "
                "cold, without spares")

    def off(self, attempt: int) -> str:
        """What status says of the addition from then on."""
        if self.addition is Addition.PROBE:
            return f"turned off after attempt {attempt}, which oomguard's probe failed ({self.frame})"
        return (f"off after attempt {attempt}, whose handover failed ({self.frame}); later attempts start cold, "
                "as with --no-spare")


def own_fault(kind: FailureKind | None, scan: OutputScanner, in_use: Collection[Addition],
              code: OwnCode, handover_lost: str | None = None) -> OwnFault | None:
    """The addition of ours (among ``in_use``) whose code raised the exception the worker died with, or
    None: the script's. ``handover_lost``: why the spare exited before the handover (the script never ran)."""
    if handover_lost is not None and Addition.SPARE in in_use:
        return OwnFault(Addition.SPARE, handover_lost)
    sites = scan.sites
    if kind is not FailureKind.CRASH or not sites or scan.lines - scan.framed_at > RECENT_LINES:
        return None
    for site in reversed(sites):  # innermost first
        relative = code.relative(site.file)
        if relative is not None and relative.startswith(LIBRARY_DIRS):
            continue  # shared code's frame: whose call it was decides
        addition = code.addition_of(site.file)
        if addition is None or addition not in in_use:
            return None
        return OwnFault(addition, code.shown(sites[-1]))
    return None
