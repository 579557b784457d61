"""What the loop learns about one attempt while it runs: progress, checkpoints, hangs, peaks.

``AttemptWatch`` folds the worker's records (``common.protocol``) and the output's evidence into the
facts the loop and the policy read; it does no I/O. Steps come first from the probe (real optimizer
steps); the worker library's progress records and the steps read from the output (``StepMatcher``)
are the fallback for a worker without it. Also here: is a silent worker hung or busy (``Liveness``,
from what its processes do), and reading the records a worker appends to its events file.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from oomguard.common import protocol
from oomguard.supervisor.observe.allocator import AllocatorReport, ProbeReport
from oomguard.supervisor.observe.checkpoints import ResumeCheck, renamed_name
from oomguard.supervisor.observe.output import OutputScanner
from oomguard.supervisor.observe.sampler import AttemptPeak, MemorySample, fold_peak
from oomguard.supervisor.units import format_size

# Is a silent worker hung, or busy? Liveness from what the process does, not only from what it says.
#
# A worker counts as hung only when, for the hang timeout, it printed nothing (no new step, where steps
# are known), wrote no checkpoint, **and** its process tree used almost no CPU, moved almost no I/O,
# **and** its GPUs showed no activity. Training that prints nothing for an hour (Lightning's Rich bar
# into a pipe, Hugging Face's Trainer with ``disable_tqdm`` and a large ``logging_steps``) keeps a core
# busy the whole time and is never cut; a process blocked on a lock, a pipe or a DataLoader whose
# workers deadlocked uses none and is.
#
# ``activity_between`` turns two memory samples into what the tree did between them; ``Liveness``
# folds those and the output's life signs into a ``Judgement`` the loop acts on: hung (with the
# figures that decided it), held alive (and why: ``silent 42 min; busy: 97% of a core``), or neither.
# Pure: the sampler's readings and the clock come in as arguments.
#
# The CPU floor comes from measurement (``bench/idle_cpu.py``: each scenario's whole process tree,
# sampled every second for 20 s after it settled, on a 2-core machine shared with other jobs, so busy
# processes got a fifth of a core or so):
#
#     =====================================================  ==========================  ==========
#     scenario                                               CPU per 1 s interval        I/O
#     =====================================================  ==========================  ==========
#     blocked on a lock (torch's pool, tqdm's monitor)       0.0 % in every interval     0 B
#     blocked reading a pipe                                 0.0 %                       0 B
#     asleep                                                 0.0 %                       0 B
#     DataLoader, 2 workers deadlocked on a lock             0.0 %                       0 B
#     gloo all_reduce whose peer never comes (2 ranks)       0.0 %                       0 B
#     HF Trainer blocked in a callback                       0.0 %                       0 B
#     training loop, 1 thread                                22.6 % at least (mean 28)   MiB/s
#     training with 2 DataLoader workers                     18.5 % at least (mean 25)   MiB/s
#     a loop spinning, printing nothing                      18.7 % at least (mean 22)   0 B
#     =====================================================  ==========================  ==========
#
# A hung tree's only CPU is a periodic wake-up (the DataLoader's 5 s status check, gloo's and tqdm's
# timers), microseconds: not one clock tick (10 ms) in a second. Work, even starved by a shared
# machine, is tens of percent. The floor, 5 % of one core, is five ticks a second: clear of a stray
# tick or two in a hung tree, and under a third of the least a busy one was seen to get.


CPU_FLOOR = 0.05  # share of one core; see the table above
# /proc counts CPU time in clock ticks of 10 ms: over a quarter-second interval one tick is already
# 4 %. An interval shorter than this is judged as if it lasted this long, so a lone tick is noise.
MIN_SPAN = 1.0  # seconds
IO_FLOOR = 1 << 20  # bytes per second: a hung tree moved none; a checkpoint or data read moves far more
GPU_BUSY_PCT = 1  # NVML utilization: any kernel running in the driver's sample period
GPU_MEMORY_MOVED = 2 << 20  # bytes: the CUDA caching allocator's smallest segment
# The learned cadence: after this many gaps between life signs, spanning at least the floor, a
# silence this many times the longest gap seen (and never under the floor) is not the worker's rhythm.
CADENCE_GAPS = 20
CADENCE_FACTOR = 5.0
CADENCE_FLOOR = 300.0  # seconds
PUBLISH_EVERY = 10.0  # seconds between two updates of the held-alive note while it holds


@dataclass(frozen=True)
class Activity:
    """What the worker's process tree did over one sampling interval."""

    seconds: float
    cpu_seconds: float | None
    io_bytes: int | None
    gpu: str | None  # what counts as GPU activity ("GPU 0 at 87%"), or None when there was none

    def busy(self) -> str | None:
        """Why the tree counts as busy in this interval, or None when it was idle."""
        span = max(self.seconds, MIN_SPAN)
        if self.cpu_seconds is not None and self.cpu_seconds >= CPU_FLOOR * span:
            return f"{100 * self.cpu_seconds / self.seconds:.0f}% of a core"
        if self.gpu is not None:
            return self.gpu
        if self.io_bytes is not None and self.io_bytes >= IO_FLOOR * span:
            return f"{format_size(self.io_bytes)} of I/O in {self.seconds:.0f} s"
        return None


def activity_between(before: MemorySample, after: MemorySample) -> Activity | None:
    """What the tree did between two samples; None when they are not an interval."""
    seconds = after.monotonic - before.monotonic
    if seconds <= 0:
        return None
    cpu = _delta(before.worker_cpu_seconds, after.worker_cpu_seconds)
    io = _delta(before.worker_io_bytes, after.worker_io_bytes)
    return Activity(seconds, cpu, None if io is None else int(io), gpu_activity(before, after))


def gpu_activity(before: MemorySample, after: MemorySample) -> str | None:
    """GPU work by the worker between two samples: its own processes' SM share where NVML gives it
    (another job's kernels on a shared GPU are not the worker's), else the device's utilization;
    or its GPU memory moving (its own processes' figure, else the device's)."""
    earlier = {g.cuda_index: g for g in before.gpus}
    for g in after.gpus:
        if g.worker_sm_pct is not None:
            if g.worker_sm_pct >= GPU_BUSY_PCT:
                return f"GPU {g.cuda_index}: its processes at {g.worker_sm_pct}% SM"
        elif g.utilization_pct is not None and g.utilization_pct >= GPU_BUSY_PCT:
            return f"GPU {g.cuda_index} at {g.utilization_pct}%"
        old = earlier.get(g.cuda_index)
        if old is not None:
            moved = abs(g.worker_or_used - old.worker_or_used)
            if moved >= GPU_MEMORY_MOVED:
                return f"GPU {g.cuda_index} memory moved {format_size(moved)}"
    return None


@dataclass
class Cadence:
    """The rhythm of one kind of life sign (steps, or output lines where no steps are known)."""

    first: float | None = None
    last: float | None = None
    gaps: int = 0
    longest: float = 0.0

    def sign(self, now: float) -> None:
        if self.last is not None:
            self.gaps += 1
            self.longest = max(self.longest, now - self.last)
        else:
            self.first = now
        self.last = now

    def timeout(self) -> float | None:
        """The silence that breaks the rhythm, once enough of it was seen; None before."""
        learned = max(CADENCE_FLOOR, CADENCE_FACTOR * self.longest)
        if self.gaps < CADENCE_GAPS or self.first is None or self.last is None:
            return None
        return learned if self.last - self.first >= CADENCE_FLOOR else None


@dataclass(frozen=True)
class Judgement:
    """What the liveness check concluded at one moment. ``hung`` is the one-line reason the attempt
    ends with; ``held`` says why a worker silent past its timeout is left running."""

    hung: str | None
    held: str | None
    figures: dict[str, Any]

    def note(self, attempt: int, wall: float) -> dict[str, Any] | None:
        """What status and the dashboard show while the worker is held alive; None when it is not."""
        if self.held is None:
            return None
        return {"attempt": attempt, "text": self.held, "busy": self.figures.get("busy"),
                "silent_since": wall - self.figures["quiet_s"], "t": wall}


@dataclass
class Idle:
    """The stretch since the tree was last busy: how long, and the most it used in any interval."""

    since: float
    cpu_seconds: float = 0.0
    seconds: float = 0.0
    max_share: float = 0.0
    io_bytes: int = 0
    cpu_known: bool = False

    def add(self, activity: Activity) -> None:
        self.seconds += activity.seconds
        if activity.cpu_seconds is not None:
            self.cpu_known = True
            self.cpu_seconds += activity.cpu_seconds
            self.max_share = max(self.max_share, activity.cpu_seconds / max(activity.seconds, MIN_SPAN))
        self.io_bytes += activity.io_bytes or 0


@dataclass
class Liveness:
    """The worker's activity and life signs over one attempt, and the hang judgement they lead to."""

    started: float
    previous: MemorySample | None = None
    idle: Idle | None = None  # set by the first sample
    busy: str | None = None  # why the tree was busy in the newest busy interval
    gpu_note: str | None = None  # why there are no GPU figures, when there are none
    output: Cadence = field(default_factory=Cadence)
    steps: Cadence = field(default_factory=Cadence)
    published: tuple[bool, float] = (False, 0.0)  # (held, when) of the last note the loop published

    def add(self, sample: MemorySample) -> None:
        """One sample of the worker's tree (the sampler's, once per interval)."""
        # Before the first sample: the tree as it was when the attempt started, nothing used yet.
        before = self.previous or replace(
            sample, monotonic=self.started, gpus=(), worker_cpu_seconds=None if sample.worker_cpu_seconds is None
            else 0.0, worker_io_bytes=None if sample.worker_io_bytes is None else 0)
        self.previous = sample
        self.gpu_note = None if sample.gpus else (sample.gpu_unavailable or "no GPU")
        activity = activity_between(before, sample)
        if activity is None:
            return
        why = activity.busy()
        if why is not None:
            self.busy, self.idle = why, Idle(sample.monotonic)
            return
        if self.idle is None:
            self.idle = Idle(self.started)
        self.idle.add(activity)

    def timeout(self, configured: float, steps_known: bool) -> tuple[float, str]:
        """The silence that counts: ``--hang-timeout``, or sooner where a steady rhythm was learned."""
        cadence, what = (self.steps, "steps") if steps_known else (self.output, "output lines")
        learned = cadence.timeout()
        if learned is not None and learned < configured:
            return learned, (f"learned cadence: {cadence.gaps} gaps between {what}, the longest "
                             f"{cadence.longest:.0f} s, × {CADENCE_FACTOR:g}")
        return configured, f"--hang-timeout {configured:g}"

    def judge(self, quiet: float, configured: float, steps_known: bool, now: float) -> Judgement:
        """Hung when silent and idle for the timeout; held when silent that long but busy."""
        timeout, source = self.timeout(configured, steps_known)
        idle_since = self.idle.since if self.idle is not None else self.started
        idle_for = now - idle_since
        what = "progress" if steps_known else "output or progress"
        figures: dict[str, Any] = {"quiet_s": round(quiet, 1), "timeout_s": round(timeout, 1), "timeout_from": source,
                                   "idle_s": round(idle_for, 1), "cpu_floor_pct": 100 * CPU_FLOOR}
        if quiet < timeout:
            return Judgement(None, None, figures)
        if idle_for < timeout:
            figures["busy"] = self.busy
            ago = f" {duration(idle_for)} ago" if idle_for >= 2 * MIN_SPAN + 1 else ""
            return Judgement(None, f"silent {duration(quiet)}; busy{ago}: {self.busy}", figures)
        figures.update(self._idle_figures())
        return Judgement(f"no {what} for {quiet:.0f} s ({source}); {self._idle_text(idle_for)}", None, figures)

    def _idle_figures(self) -> dict[str, Any]:
        idle = self.idle
        cpu = idle if idle is not None and idle.cpu_known else None  # None where no CPU figure was read
        return {"cpu_max_pct": cpu and round(100 * cpu.max_share, 2), "cpu_seconds": cpu and round(cpu.cpu_seconds, 3),
                "io_bytes": idle and idle.io_bytes, "gpu": self.gpu_note or "idle"}

    def _idle_text(self, idle_for: float) -> str:
        idle = self.idle
        if idle is None or not idle.cpu_known:
            return "no CPU figures of its processes"
        gpu = f"no GPU figures: {self.gpu_note.removeprefix('GPU figures unavailable: ')}" if self.gpu_note else (
            "its GPUs idle")
        return (f"idle for {idle_for:.0f} s: CPU at most {100 * idle.max_share:.1f}% of a core "
                f"(floor {100 * CPU_FLOOR:g}%), {format_size(idle.io_bytes)} of I/O, {gpu}")

    def news(self, judgement: Judgement, now: float) -> str | None:
        """Whether to publish the held-alive note now: "held", "still held" (every ``PUBLISH_EVERY``
        seconds, not with every tick), "released", or None (nothing new)."""
        held = judgement.held is not None
        was_held, when = self.published
        if held == was_held and (not held or now - when < PUBLISH_EVERY):
            return None
        self.published = (held, now)
        return "released" if not held else "still held" if was_held else "held"


def _delta(before: float | int | None, after: float | int | None) -> float | None:
    if before is None or after is None:
        return None
    return max(0.0, float(after - before))  # a process that left the tree takes its time with it


def duration(seconds: float) -> str:
    """``12 s``, ``4 min``, ``2.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# Training progress read from the worker's output, for scripts that do not use the worker library.
#
# ``StepMatcher`` maps one line of output to the step it reports (and the total, when the line shows
# one), or None. Built-in patterns cover what the common trainers print by default; ``--progress-pattern``
# adds the user's own (a regular expression with a named group ``step`` and optionally ``total``),
# tried first. Pure: the output thread feeds it lines, the loop reads what ``observe.progress`` kept.
#
# Progress only from progress: a number in a path or a file name is the step of a file
# (``ckpts/epoch=0-step=4.ckpt``, ``out/checkpoint-500``), and a line about saving, loading, restoring
# or resuming a checkpoint names the step it was written at, not the step training is at. Both are
# taken out before any pattern looks at the line. A progress bar is read before that rule, so a log
# line glued to a bar's redraw (``2/6 [00:03<00:07][transformers] Saving model checkpoint to ...``)
# still gives the bar's step. ``tests/progress_corpus/`` holds real lines captured from Lightning, the
# Hugging Face Trainer, Accelerate, nanoGPT and nanochat, each with the step it shows, and the tests
# check every one of them.


# Terminal control sequences: colours and cursor moves of a bar drawn for a terminal (Rich when it
# renders, tqdm's nested bars' cursor-up).
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# Lightning's bars that are not training: their numbers are batches of another loop.
_OTHER_LOOP = re.compile(r"^\s*(?:Sanity Checking|Validation|Testing|Predicting)\b")
# A token that is a path (a slash next to a letter: ``out/checkpoint-2``, not ``45/100``), a file
# name with a known extension, or a name formatted from metrics (Lightning's ``epoch=0-step=4``).
_PATHLIKE = re.compile(
    r"""[^\s'"`\[\](){}]*(?:[A-Za-z_.~][/\\]|[/\\][A-Za-z_.~])[^\s'"`\[\](){}]*"""
    r"""|[^\s'"`\[\](){}]+\.(?:ckpt|pt|pth|bin|safetensors|pkl|pickle|json|ya?ml|npz|npy|h5|hdf5|msgpack|tar|zip"""
    r"""|gz|distcp|model|parquet)\b[^\s'"`]*"""
    r"""|[^\s'"`\[\](){}]*\w=\d+[-_]\w+=\d+[^\s'"`\[\](){}]*"""
)
# A line about a checkpoint being saved, loaded, restored or resumed from, or batches being skipped.
_CHECKPOINT_MESSAGE = re.compile(
    r"\b(?:restor\w*|resum\w*|continu\w* training|sav(?:e|es|ed|ing)|load(?:s|ed|ing)?|skip(?:s|ped|ping)?"
    r"|checkpoint\w*|ckpt)\b", re.IGNORECASE)
# A bar's own description, when it has one, must say it is training: "Map", "Writing model shards"
# and "Loading checkpoint shards" count other things.
_TRAINING_DESCRIPTION = re.compile(r"^\s*$|\b(?:epoch|train|step|iter|batch|update|optim)", re.IGNORECASE)

# Bars, read before the checkpoint-message rule. Each has the named group ``step`` and maybe ``total``
# and ``epoch``; ``per_epoch`` marks a bar that counts batches within an epoch (Lightning's).
_BARS: tuple[re.Pattern[str], ...] = (
    # Lightning's Rich bar: "Epoch 2/4  ━━━━━━━━━━╸━━━━━━━━━ 5/8 0:00:04 • 0:00:03 1.69it/s v_num: 0"
    re.compile(r"^\s*Epoch (?P<epoch>\d+)/(?P<epochs>-?\d+)\s+[^\d\s]*\s*(?P<step>\d+)/(?P<total>\d+)\s"),
    # Lightning's TQDM bar: "Epoch 2:  45%|████▌     | 45/100 [00:03<00:04, 13.52it/s, v_num=0]"
    re.compile(r"^\s*Epoch (?P<epoch>\d+):.*?\|\s*(?P<step>\d+)/(?P<total>\d+) \["),
    # tqdm (Hugging Face Trainer, Accelerate scripts): " 40%|████      | 40/100 [00:12<00:18,  3.30it/s]",
    # with or without the percentage block: "12/100 [00:01<00:09"
    re.compile(r"^(?P<desc>[^|\[]*?)(?::\s*)?(?:\d+%\|[^|]*\|\s*|(?<!\S))(?P<step>\d+)/(?P<total>\d+) \[\d"),
)
# Text lines, read after it. nanoGPT: "iter 120: loss 3.2100, time 41.23ms" and "step 250: train loss 2.9";
# nanochat: "step 00120/01000 (12.00%) | loss: 3.21"; "Step: 120 / 1000"; "global_step=120"; "step 120".
_TEXT: tuple[re.Pattern[str], ...] = (
    re.compile(r"^\s*(?:iter|step) (?P<step>\d+): "),  # nanoGPT
    re.compile(r"\b(?:global_)?step[\s:=]+(?P<step>\d+)\s*/\s*(?P<total>\d+)\b", re.IGNORECASE),  # step N/M
    re.compile(r"\b(?:global[_ ])?step[\s:=]+(?P<step>\d+)\b", re.IGNORECASE),  # step N
)


@dataclass(frozen=True)
class StepSeen:
    step: int
    total: int | None


def compile_pattern(text: str) -> re.Pattern[str]:
    """The user's ``--progress-pattern``; ValueError (naming the fix) when it cannot be used."""
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise ValueError(f"{text!r} is not a regular expression ({exc})") from None
    if "step" not in pattern.groupindex:
        raise ValueError(f"{text!r} has no named group 'step'; write e.g. 'it=(?P<step>\\d+)'")
    return pattern


class StepMatcher:
    """Line -> StepSeen or None; a custom pattern first. ``batches_per_step``: the worker's gradient
    accumulation (Lightning's bars count batches; everyone else counts optimizer steps)."""

    def __init__(self, custom: str | None = None, batches_per_step: int = 1) -> None:
        self.custom = compile_pattern(custom) if custom else None
        self.batches_per_step = max(1, batches_per_step)

    def match(self, line: str) -> StepSeen | None:
        if len(line) > 2000 or not any(c.isdigit() for c in line):  # cheap exits for the common line
            return None
        if "\x1b" in line:
            line = _ANSI.sub("", line)
        if self.custom is not None and (seen := _read(self.custom.search(line))) is not None:
            return seen
        if _OTHER_LOOP.match(line):
            return None
        line = _PATHLIKE.sub(" ", line) if ("/" in line or "." in line or "=" in line or "\\" in line) else line
        for pattern in _BARS:
            if (m := pattern.search(line)) is not None and (seen := self._bar(m)) is not None:
                return seen
        if _CHECKPOINT_MESSAGE.search(line):
            return None
        for pattern in _TEXT:
            if (seen := _read(pattern.search(line))) is not None:
                return seen
        return None

    def _bar(self, m: re.Match[str]) -> StepSeen | None:
        groups = m.groupdict()
        if groups.get("desc") is not None and not _TRAINING_DESCRIPTION.search(groups["desc"]):
            return None
        step, total = int(m.group("step")), int(m.group("total"))
        if groups.get("epoch") is None:
            return StepSeen(step, total)
        # Lightning counts batches within the epoch: epoch × batches per epoch + batch, in optimizer
        # steps. The Rich bar also shows the last epoch ("Epoch 2/4"), hence the run's total.
        per = self.batches_per_step
        epochs = int(groups["epochs"]) + 1 if groups.get("epochs") and int(groups["epochs"]) >= 0 else None
        return StepSeen((int(groups["epoch"]) * total + step) // per, epochs * total // per if epochs else None)


def _read(m: re.Match[str] | None) -> StepSeen | None:
    if m is None:
        return None
    try:
        total = m.groupdict().get("total")
        return StepSeen(int(m.group("step")), int(total) if total else None)
    except (TypeError, ValueError, IndexError):  # a custom pattern whose group matched no number
        return None


PROGRESS_EVENT_EVERY = 10.0  # progress records are journaled as events at most this often
STAMP_SLACK = 0.25  # seconds: see AttemptWatch.step_at
MAX_SAVED = 4096  # the files of save records kept per attempt (the look-alike check's evidence)
MTIME_SLACK = 0.05  # seconds: a file's mtime comes from the kernel's coarse clock, a tick behind time.time()
REQUEST_COOLDOWN = 60.0  # seconds between two checkpoint requests for memory
_ALIVE = (protocol.PROGRESS, protocol.HEARTBEAT, protocol.CHECKPOINT, protocol.BATCH, protocol.STEP)


@dataclass(frozen=True)
class Save:
    """One ``torch.save`` the probe saw: when it ran, the optimizer step at its start, and the file it
    wrote, made real (None for a file object or a buffer)."""

    began: float
    returned: float
    step: int
    path: str | None = None

    def wrote(self, real: str, directory: bool) -> bool:
        """It wrote ``real`` (with ``directory``, a file inside it), maybe under a temp name renamed to it."""
        if self.path is None:
            return False
        if self.path == real or (directory and self.path.startswith(real + os.sep)):
            return True
        return self._renamed_to(real, directory)

    def _renamed_to(self, real: str, directory: bool) -> bool:
        """A save to ``ckpt.pt.tmp`` (or into ``.step_4.tmp/``) then renamed: the index only sees
        the final name, and the rename keeps the file's mtime, so the save's run still holds it."""
        assert self.path is not None
        parent, name = os.path.split(real)
        if not self.path.startswith(parent + os.sep):
            return False
        parts = self.path[len(parent) + 1:].split(os.sep)
        if (len(parts) > 1) != directory:  # a file in the temp directory, or the temp file itself
            return False
        return renamed_name(parts[0]) == name


@dataclass
class AttemptWatch:
    """What the loop learns while one attempt runs."""

    scanner: OutputScanner = field(default_factory=OutputScanner)
    last_progress: float = field(default_factory=time.monotonic)
    progress_records: int = 0
    last_step: int | None = None
    new_checkpoint: bool = False
    worker_failure: dict[str, Any] | None = None
    peak: AttemptPeak | None = None
    progress: dict[str, Any] | None = None  # the newest progress record, written with the next sample
    last_progress_event: float = -PROGRESS_EVENT_EVERY
    started: float = field(default_factory=time.monotonic)
    last_request: float = -REQUEST_COOLDOWN
    matcher: StepMatcher = field(default_factory=StepMatcher)
    output_steps: int = 0  # step increases read from the output (scripts without the worker library)
    first_progress: float | None = None  # monotonic time of the first step seen
    first_step: int = 0
    total_steps: int | None = None  # from the output's step lines, when they show one
    steps_at: list[tuple[float, int]] = field(default_factory=list)  # (wall time, step) as steps advance
    saves: list[Save] = field(default_factory=list)  # the probe's torch.save records, the newest 64
    saved_paths: list[str] = field(default_factory=list)  # the files its torch.save wrote, made real (MAX_SAVED)
    resume: ResumeCheck | None = None  # started from a checkpoint of known step: did it resume there?
    allocator: AllocatorReport = field(default_factory=AllocatorReport)  # the probe's steps and allocator figures
    liveness: Liveness = field(init=False)  # what its processes do, and the hang judgement
    probe: ProbeReport = field(default_factory=ProbeReport)  # whether the probe is in the worker, or why not

    def __post_init__(self) -> None:
        self.liveness = Liveness(self.started)

    def feed_line(self, line: str) -> None:
        """One line of the worker's output (called by the output thread): evidence and progress."""
        self.scanner.feed(line)
        now = time.monotonic()
        self.liveness.output.sign(now)
        seen = self.matcher.match(line.rsplit("\r", 1)[-1])  # a carriage-return bar: its newest state
        if seen is not None:
            self.note_step(seen, now, time.time())

    def note_step(self, seen: StepSeen, now: float, wall: float) -> None:
        """A step read from the output. Steps only count going up: an evaluation bar's 5/10 printed
        at training step 400 is not a step back, and output without a new step is not progress."""
        if self.allocator.step is not None:  # the probe counts the steps; a bar still tells the total
            if seen.total:
                self.total_steps = max(seen.total, self.total_steps or 0)
            return
        if self.resume is not None:
            self.resume.see(seen.step, seen.total)
        current_total = self.total_steps  # kept here: ``progress`` is cleared once journaled
        if seen.total and current_total and seen.total != current_total:
            # Another bar: a longer one is the training loop (after "Loading shards 2/2"), a
            # shorter one an evaluation inside it.
            if seen.total < current_total:
                return
            self.first_progress = None
        elif self.last_step is not None and seen.step <= self.last_step:
            return
        total = self.total_steps = seen.total or current_total
        self.output_steps += 1
        self.last_step = seen.step
        self.last_progress = now
        first = self._stepped(seen.step, now)
        self.steps_at = (self.steps_at + [(wall, seen.step)])[-256:]
        eta = None
        if total and now > first and seen.step > self.first_step:
            eta = max(0.0, (total - seen.step) / ((seen.step - self.first_step) / (now - first)))
        self._progress(seen.step, wall, "output", eta)

    def _stepped(self, step: int, now: float) -> float:
        """A step seen (the learned cadence counts real steps); when the first was seen."""
        self.liveness.steps.sign(now)
        if self.first_progress is None:
            self.first_progress, self.first_step = now, step
        return self.first_progress

    def _progress(self, step: int, wall: float, source: str, eta: float | None = None, **figures: Any) -> None:
        self.progress = {"type": protocol.PROGRESS, "step": step, "total_steps": self.total_steps, "eta_s": eta,
                         "t": wall, "source": source, **figures}

    def step_at(self, wall: float) -> int | None:
        """The step of a checkpoint written at ``wall`` (its mtime): the probe's ``torch.save`` that was
        writing then, else the last step shown at or before it."""
        # The save whose run is nearest the mtime (inside it, or a coarse clock's tick before it).
        nearest = min(((max(s.began - wall, wall - s.returned, 0.0), -i, s.step)
                       for i, s in enumerate(self.saves)), default=None)
        if nearest is not None and nearest[0] <= MTIME_SLACK:
            return nearest[2]
        # A line is stamped when read, a beat after it was printed (and a file's mtime comes from
        # the kernel's coarse clock), so a step printed just before the save can be stamped after
        # it: allow a quarter second, less than the two iterations a later step would take.
        before = [step for t, step in self.steps_at if t <= wall + STAMP_SLACK]
        return before[-1] if before else None

    def saved_step(self, path: str, mtime: float, directory: bool) -> int | None:
        """The step of the probe's save of ``path`` (of a file inside it, for a directory): the save whose
        run holds the file's mtime; for a directory (whose last file may be no save of torch's, HF's
        ``trainer_state.json``) the newest save into it that began by then."""
        real = os.path.realpath(path)
        mine = [s for s in self.saves if s.wrote(real, directory) and s.began <= mtime + MTIME_SLACK]
        if not directory:
            mine = [s for s in mine if s.returned >= mtime - MTIME_SLACK]
        return mine[-1].step if mine else None

    @property
    def steps_known(self) -> bool:
        """Steps were reported: by the probe, the worker library or the output."""
        return self.progress_records > 0 or self.output_steps > 0 or self.allocator.records > 0

    @property
    def progressed(self) -> bool:
        """The attempt made progress: steps reported or a checkpoint."""
        return self.steps_known or self.new_checkpoint

    def running_since(self) -> float:
        """When stable running began (for --grow-after): the first step seen, else the attempt's start."""
        return self.first_progress if self.first_progress is not None else self.started

    def observe(self, sample: MemorySample) -> None:
        """One memory sample of the worker: its peaks, and what its processes did since the last."""
        self.peak = fold_peak(self.peak, sample)
        self.liveness.add(sample)

    def checkpoint_landed(self, step: int | None, now: float, wall: float) -> None:
        """A new checkpoint settled: progress, and where its name carries a step (read by the
        checkpoint index from the file it found, not from the output), the step it was written at."""
        self.new_checkpoint = True
        self.last_progress = now
        if step is not None and (self.last_step is None or step > self.last_step):
            self.last_step = step
            self._progress(step, wall, "checkpoint")

    @property
    def peak_rss(self) -> int:
        return self.peak.worker_rss_bytes if self.peak else 0

    def take(self, record: dict[str, Any], now: float) -> bool:
        """Fold one worker record in; True when it should be journaled as an event. Progress
        records are many: the meta and the attempt's last step carry them, events stay few."""
        kind = record["type"]
        if kind in _ALIVE:
            self.last_progress = now
        if kind in (protocol.STEP, protocol.OOM):
            return self._take_probe(record, now)
        if kind == protocol.SAVE:
            self._take_save(record)
            return False  # the checkpoint, once it settles, is the event
        if kind == protocol.PROGRESS:
            if self.resume is not None and isinstance(record.get("step"), int):
                self.resume.see(record["step"], record.get("total_steps"))
            self.liveness.steps.sign(now)
            self.progress_records += 1
            if self.allocator.step is None:  # the probe's count, where there is one, is the step
                self.last_step = record.get("step", self.last_step)
            self.progress = record
            return self._progress_event_due(now)
        if kind == protocol.FAILURE:
            self.worker_failure = record
        elif kind == protocol.PROBE:
            self.probe.take(record)
            return record.get("state") != "loaded"  # one per process: the meta counts them; failures are events
        return kind != protocol.HEARTBEAT

    def _progress_event_due(self, now: float) -> bool:
        if now - self.last_progress_event < PROGRESS_EVENT_EVERY:
            return False
        self.last_progress_event = now
        return True

    def _take_save(self, record: dict[str, Any]) -> None:
        """The probe's record of one ``torch.save``: when it ran and at which step (see step_at). A
        save before the process's first step says no step: the output's, if any, stands for it."""
        began, returned, step, path = record.get("started"), record.get("t"), record.get("step"), record.get("path")
        real = os.path.realpath(path) if isinstance(path, str) else None
        if real is not None and len(self.saved_paths) < MAX_SAVED:  # a save before the first step wrote it too
            self.saved_paths.append(real)
        if isinstance(began, (int, float)) and isinstance(returned, (int, float)) and isinstance(step, int):
            self.saves = (self.saves + [Save(float(began), float(returned), step, real)])[-64:]

    def _take_probe(self, record: dict[str, Any], now: float) -> bool:
        """A probe record: a step record is progress (journaled as an event at most every
        ``PROGRESS_EVENT_EVERY``), an ``oom`` or ``probe`` record an event."""
        if not self.allocator.take(record):
            return True
        step = self.allocator.step
        assert step is not None
        if self.resume is not None:
            self.resume.see(step, self.total_steps)
        self._stepped(step, now)
        stamp = record.get("t")
        wall = float(stamp) if isinstance(stamp, (int, float)) else time.time()
        if self.last_step is None or step > self.last_step or not self.steps_at:
            self.steps_at = (self.steps_at + [(wall, step)])[-256:]
        self.last_step = step
        rate, total = self.allocator.steps_per_s, self.total_steps
        self._progress(step, wall, "probe", max(0.0, (total - step) / rate) if total and rate else None,
                       **self.allocator.figures())
        return self._progress_event_due(now)

    def check_hang(self, last_output: float, timeout: float, now: float) -> Judgement | None:
        """Hung (silent and idle for the timeout), held alive despite its silence, or neither; None with hangs off."""
        if timeout <= 0:
            return None
        # Where steps are known (records or output), output without a new step is not progress:
        # a script printing warnings in a loop is still silent.
        quiet = now - (self.last_progress if self.steps_known else max(last_output, self.last_progress))
        return self.liveness.judge(quiet, timeout, self.steps_known, now)

    def request_pending(self, request_file_exists: bool, now: float) -> bool:
        """A checkpoint request already written and still fresh is not repeated."""
        return request_file_exists and now - self.last_request < REQUEST_COOLDOWN


# Reading the structured records a worker appends to its events file (see common/protocol.py).


class ChannelReader:
    """Tails one attempt's events file; a torn last line waits for the rest of it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        records = [protocol.decode(line.decode("utf-8", "replace")) for line in lines if line.strip()]
        return [r for r in records if r is not None]
